#!/usr/bin/env python
"""Regenerate docs/megatron_flags.md from the parser (arguments.py) and the mapped/rejected
tables (megatron_compat.py):  python scripts/megatron_flags_doc.py"""

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron.training.arguments import build_parser  # noqa: E402
from megatron.training.megatron_compat import MAPPED, PARALLEL_SIZES, REJECTED  # noqa: E402

HEADER = """# Megatron-LM flags: honoured, mapped, rejected

Every Megatron-LM flag `pretrain_gpt.py` knows, and what it does here. A flag that is in
none of the tables gets argparse's `unrecognized arguments`, with the closest known flag
suggested. `tests/unit_tests/training/test_megatron_flags_doc.py` keeps this page in step
with the code; regenerate it with `python scripts/megatron_flags_doc.py`.

Counts: **{honoured} honoured**, **{mapped} mapped** ({sizes} of them parallel sizes, accepted
at 1), **{rejected} rejected**.

Upstream command lines: `tests/functional_tests/upstream_gpt_configs.json` holds 14 of
upstream's GPT functional-test configurations; all parse here after the CPU substitutions
(nccl -> gloo, transformer_engine -> local, parallel sizes 1, tiny model, mock data), and two
train on 2 ranks (`tests/functional_tests/test_megatron_command_lines.py`). Of upstream's 206
GPT test configurations, 91 use no flag outside the honoured and mapped tables; the others
use inference/RL flags, MoE, pipeline stages, recomputation options or other rejected
features.

Deviations worth knowing:

- `--log-memory-to-tensorboard` on CPU writes `mem-rss-bytes` and `mem-max-rss-bytes` (there
  is no CUDA allocator); on CUDA Megatron's `mem-reserved-bytes`, `mem-allocated-bytes`,
  `mem-max-allocated-bytes`, `mem-allocated-count`.
- `--attention-softmax-in-fp32` runs the whole attention (scores, softmax, weighted sum) in
  fp32 when its inputs are bf16/fp16, then casts back.
- `--apply-layernorm-1p` stores `gamma - 1` in `weight`: a checkpoint of such a model is not
  a plain LayerNorm checkpoint (add 1 when converting).
- The fp16 loss scale is saved with the optimizer state (`grad_scaler` in common.json).
- "number of skipped/nan iterations" count the current log interval, as upstream.
- `--tensorboard-log-interval` governs the per-iteration scalars (loss, learning rate, grad
  norm, ...); the MoE metrics (aux losses, token loads) go to TensorBoard every
  `--log-interval`, averaged over it like the console line (upstream writes them every
  iteration). The TensorBoard tags are this trainer's (`lm-loss`, `global-batch-size`),
  without upstream's `... vs samples` copies.
- `--moe-token-dispatcher-type allgather` (upstream's default) runs the all-to-all dispatcher,
  which gives the same results; `--expert-model-parallel-size` above 1 needs `--use-mfsdp`.
- The MoE load-balancing types are upstream's (`aux_loss` per micro-batch per rank,
  `seq_aux_loss` per sequence, `global_aux_loss` over the data-parallel ranks, `sinkhorn`,
  `none`, or a list of aux-loss types with one `--moe-aux-loss-coeff` each); the log line's
  `load_balancing_loss` / `seq_load_balancing_loss` / `global_load_balancing_loss` / `z_loss`
  are the losses divided by their coefficients, the mean over MoE layers (docs/design.md,
  "Mixture of experts").
- `--moe-router-enable-expert-bias`: the bias is updated after every optimizer step that
  updates the router (upstream: in `finalize_model_grads`, before the step; the next step
  routes with the same bias). A skipped step (fp16 overflow) updates nothing; its token
  counts join the next step's (upstream updates on skipped steps too).
"""


def rows():
    honoured, seen = [], set()
    for action in build_parser()._actions:
        flags = [s for s in action.option_strings if s.startswith("--")]
        if not flags or flags[0] == "--help" or flags[0] in seen:
            continue
        if flags[0] in MAPPED or flags[0] in REJECTED or flags[0] in PARALLEL_SIZES:
            continue
        seen.add(flags[0])
        text = "" if action.help in (None, argparse.SUPPRESS) else action.help.replace("|", "/")
        honoured.append((" ".join(f"`{f}`" for f in flags), text))
    return honoured


def main():
    honoured = rows()
    out = [HEADER.format(honoured=len(honoured), mapped=len(MAPPED) + len(PARALLEL_SIZES),
                         sizes=len(PARALLEL_SIZES), rejected=len(REJECTED)),
           "## Honoured", "", "These change behaviour as they do in Megatron-LM.", "",
           "| flag | effect here |", "|---|---|"]
    out += [f"| {flags} | {text} |" for flags, text in honoured]
    out += ["", "## Mapped", "", "Accepted; the effect is the one described (a no-op where the behaviour is",
            "always on, or a synonym of one of our settings).", "", "| flag | here |", "|---|---|"]
    out += [f"| `{flag}` | {note} |" for flag, (_, note) in MAPPED.items()]
    out += [f"| `{flag}` | accepted at 1; larger values: \"not supported yet\" |" for flag in PARALLEL_SIZES]
    out += ["", "`--use-distributed-optimizer` without `--use-mfsdp` (upstream's DDP + distributed optimizer)",
            "is in the honoured table: it runs MFSDP with `--data-parallel-sharding-strategy optim`",
            "(ZeRO-1: optimizer state sharded, gradients and parameters replicated).", "",
            "## Rejected", "", "Recognised and refused with this message; the run does not start.", "",
            "| flag | what to do |", "|---|---|"]
    out += [f"| `{flag}` | {message} |" for flag, message in REJECTED.items()]
    with open(os.path.join(REPO, "docs", "megatron_flags.md"), "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"{len(honoured)} honoured, {len(MAPPED) + len(PARALLEL_SIZES)} mapped, {len(REJECTED)} rejected")


if __name__ == "__main__":
    main()
