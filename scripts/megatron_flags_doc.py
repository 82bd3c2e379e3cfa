#!/usr/bin/env python
"""Regenerate docs/megatron_flags.md from the parser (arguments.py) and the mapped/rejected
tables (megatron_compat.py):  python scripts/megatron_flags_doc.py"""

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron.training.arguments import build_parser  # noqa: E402
from megatron.training.megatron_compat import MAPPED, REJECTED  # noqa: E402
from doc_figures import keep_figures  # noqa: E402  (scripts/, this file's directory)

HEADER = """# Megatron-LM flags: honoured, mapped, rejected

Every Megatron-LM flag `pretrain_gpt.py` knows, and what it does here. A flag that is in
none of the tables gets argparse's `unrecognized arguments`, with the closest known flag
suggested. `tests/unit_tests/training/test_megatron_flags_doc.py` keeps this page in step
with the code; regenerate it with `python scripts/megatron_flags_doc.py`.

Counts: **{honoured} honoured**, **{mapped} mapped**, **{rejected} rejected**.

Upstream command lines: `python scripts/replay_upstream_configs.py` parses every GPT
functional-test configuration of upstream (from the mirror, or from its snapshot
`tests/upstream_lines/upstream_gpt_configs.json`) after the CPU substitutions (nccl ->
gloo, transformer_engine -> local, FP8 / NCCL user-buffer / TP-comm-overlap flags dropped,
tiny model, mock data or, for --fim-data, a tiny text dataset) at each line's own TP/PP/CP sizes, and prints the accepted count and
the remaining rejections by flag. <!-- figure: replay-gpt-flags-doc -->x<!-- /figure -->
(`tests/upstream_lines/test_upstream_replay.py` keeps this count from dropping); two
train on 2 ranks (`tests/upstream_lines/test_megatron_command_lines.py`). With `--suite
moe` it replays upstream's MoE recipes (`test_cases/moe`, snapshot
`upstream_moe_configs.json`): <!-- figure: replay-moe-flags-doc -->x<!-- /figure --> (16 before the
GPU-only flags, YaRN, `--recompute-modules`, MTP and EP without `--use-mfsdp`; 32 before
Muon); of the six Muon lines two still carry the rejected
`--check-weight-hash-across-dp-replicas-interval`. `--train` trains a fixed sample of 24
GPT and MoE lines 3 iterations each at their own TP/PP/CP/EP on 2-8 CPU ranks
(`tests/upstream_lines`, a stage of its own in `scripts/run_tests.sh`).

Upstream launch scripts: `python scripts/replay_upstream_examples.py` runs each
`pretrain_gpt.py` script of upstream's `examples/` under bash with stub launchers, records
its argv (snapshot `tests/upstream_lines/upstream_example_scripts.json`) and parses it with
the same substitutions at the script's own TP/PP/CP/EP; `--train` also trains each accepted
line 3 iterations on 8 CPU ranks (docs/design.md, "Upstream's launch scripts").

Deviations worth knowing:

- `--sequence-parallel` with `--tensor-model-parallel-size 1` is turned off with one
  warning line, as upstream does.
- `--decoupled-lr` applies to `embedding.word_embeddings.weight` and an untied
  `output_layer.weight` (upstream's `is_embedding_or_output_parameter`), on the same warmup
  and decay; `--decoupled-min-lr` defaults to `--min-lr`, and without `--decoupled-lr` it
  is an error (upstream ignores it). Adding or dropping `--decoupled-lr` between a save and
  a resume changes the optimizer's parameter groups: the load refuses with that message
  (resume with `--no-load-optim`).
- `--save-retain-interval N` deletes, once a save is complete and tracked, the previously
  tracked checkpoint unless its iteration is a multiple of N (upstream's rule; the latest
  one is never deleted); it is renamed to `iter_XXXXXXX.del` before removal, so a kill
  mid-deletion leaves nothing half-deleted under a loadable name.
- `--rotary-interleaved` checkpoints do not convert to Hugging Face (Llama/Mixtral rotate
  halves); `tools/checkpoint/convert.py --to safetensors` keeps them, flag recorded.
- `--rampup-batch-size` needs `--train-samples` (as upstream); `--step-batch-size-schedule`
  thresholds are tokens (divided by `--seq-length`). Every batch size of either schedule
  must be a multiple of micro-batch x data-parallel size, checked at parse time (upstream
  checks the current one at each step). Evaluation keeps `--eval-global-batch-size`
  (default: the final global batch) throughout.
- A user error under torchrun: ranks other than 0 wait (up to 30 s, through torchrun's
  store) until rank 0 has printed the one line, so torchrun cannot kill rank 0 first.
- `--rerun-mode` defaults to `validate_results`, as upstream (each step: one all-reduce of
  an int and a copy of the RNG states); `disabled` skips a NaN/Inf step instead of stopping
  (upstream raises), and with the ft flags the default turns into `disabled` (one note
  line). A fatal check (NaN/Inf loss) that a re-run reproduces saves a checkpoint with the
  machine's state (per rank: the failed call, its result, node and device, the step's
  micro-batches) and exits 16; resumed, the step runs once more: on the same node and
  device it exits 16 again, elsewhere 17 with upstream's verdict. Unlike upstream, a job
  resumed with its optimizer state validates its first step and keeps the spike statistics
  (a resumed run judges like an uninterrupted one). `--error-injection-rate` needs
  `validate_results`.
- `--check-weight-hash-across-dp-replicas-interval` also works under MFSDP ZeRO-3 (upstream
  refuses it): the ranks holding the same shard are compared (none under plain ZeRO-3, the
  outer replicas under HSDP), and under ZeRO-1/2 the replicated compute copies; a mismatch
  exits 1 with one line naming the diverging rank(s) (upstream: an assertion).

- `--log-memory-to-tensorboard` on CPU writes `mem-rss-bytes` and `mem-max-rss-bytes` (there
  is no CUDA allocator); on CUDA Megatron's `mem-reserved-bytes`, `mem-allocated-bytes`,
  `mem-max-allocated-bytes`, `mem-allocated-count`.
- `--attention-softmax-in-fp32` runs the whole attention (scores, softmax, weighted sum) in
  fp32 when its inputs are bf16/fp16, then casts back.
- `--qk-layernorm` works with `--transformer-impl local` too (upstream needs Transformer
  Engine's norm or a spec); with `--apply-layernorm-1p` the q/k norms are zero-centered as
  well. Their weights are not decayed (upstream's default); `--apply-wd-to-qk-layernorm` is
  refused until the trainer passes it to the optimizer (`OptimizerConfig` has the rule).
- `--attention-output-gate` lays the gate rows out as upstream does (per query group, after
  the group's query rows); Hugging Face conversion refuses such checkpoints.
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
  which gives the same results; `--expert-model-parallel-size` above 1 without `--use-mfsdp`
  (upstream's DDP) runs MFSDP with `--data-parallel-sharding-strategy no_shard`, DDP's
  replicated layout (torch's DDP would average different experts), with one line saying so.
- The MoE load-balancing types are upstream's (`aux_loss` per micro-batch per rank,
  `seq_aux_loss` per sequence, `global_aux_loss` over the data-parallel ranks, `sinkhorn`,
  `none`, or a list of aux-loss types with one `--moe-aux-loss-coeff` each); the log line's
  `load_balancing_loss` / `seq_load_balancing_loss` / `global_load_balancing_loss` / `z_loss`
  are the losses divided by their coefficients, the mean over MoE layers (docs/design.md,
  "Mixture of experts").
- Flags that only choose GPU kernels, CUDA graphs, activation offloading or communication
  overlap (`--moe-permute-fusion`, `--moe-router-fusion`, `--overlap-moe-expert-parallel-comm`,
  `--delay-wgrad-compute`, the flex dispatcher `--moe-token-dispatcher-type flex` with
  `--moe-enable-deepep` / `--moe-flex-dispatcher-backend`, `--cuda-graph-*`, ...) are
  accepted and change no number; each one given prints one line at launch saying what
  runs instead (`megatron_compat.ANNOUNCED`).
- `--position-embedding-type yarn` with `--rotary-scaling-factor`, `--mscale`,
  `--mscale-all-dim`, `--yarn-original-max-position-embeddings`, `--yarn-beta-fast`,
  `--yarn-beta-slow`: Megatron-LM's `YarnRotaryEmbedding` for standard attention (cos and
  sin carry the concentration factor). Hugging Face computes the factor as 0.1 ln s + 1
  whenever `mscale` or `mscale_all_dim` is 0, Megatron as m(s, mscale) / m(s,
  mscale_all_dim): they differ only for `--mscale` != 1 with `--mscale-all-dim 0`; we
  follow Megatron. Not with `--rotary-interleaved` or `--rotary-percent` < 1.
- `--optimizer muon` (and the deprecated `dist_muon`, which adds `--use-distributed-optimizer`)
  with upstream's `--muon-*` flags and defaults: Muon for every trainable 2-D weight but the
  word embedding and output layer (the router weight, the experts and a learned position
  embedding included, as upstream;
  `linear_qkv` split into its query, key and value matrices, each expert its own matrix),
  AdamW (`--adam-*`) for the rest, one optimizer and one checkpoint state. Under MFSDP each
  matrix's update is gathered from its row shards, orthogonalized whole, and cut back:
  the same update as one process (docs/design.md, "Muon"). `--muon-tp-mode distributed`
  gathers like `duplicated` (the same values; upstream spreads the Newton-Schulz work over
  TP instead). Refused: `--fp16`, `--muon-scalar-optimizer lion`,
  `--muon-fp32-matmul-prec low` (not a torch precision), an unknown
  `--muon-coefficient-type` (`custom` included: it needs coefficients no flag gives). `--muon-use-syrk` is announced (no Triton
  kernel).
- `--recompute-modules` (with `--recompute-granularity selective`): `core_attn`,
  `layernorm`, `mlp`, `moe`, `moe_act` (needs `--moe-grouped-gemm`, as upstream),
  `shared_experts`, `gdn_norm_out` (needs `--experimental-attention-variant gdn`);
  `mla_up_proj` (needs `--multi-latent-attention`: the up projections and RoPE run again
  in backward); `gdp_in_proj`, `gdp_qkv`, `mhc` are refused (their modules do not exist
  here). `layernorm`, `moe_act` and `gdn_norm_out` recompute a discarded output through
  saved-tensor hooks (docs/design.md).
- `--experimental-attention-variant gdn` (or its deprecated alias `gated_delta_net`) with
  `--linear-attention-freq` and the `--linear-*` shapes: Qwen3-Next's gated delta net
  (megatron/core/transformer/gated_delta_net.py) on the marked layers, softmax attention on
  the others. Upstream's `gdn2` and `dsa` are refused; not with `--context-parallel-size`
  > 1 or `--multi-latent-attention`; an MTP layer keeps softmax attention.
- `--logging-level N` sets the root Python logger's level (else `MEGATRON_LOGGING_LEVEL`).
- `--mtp-num-layers D`: DeepSeek-V3's multi-token prediction (upstream's module names
  `mtp.layers.{{k}}.{{enorm,hnorm,eh_proj,mtp_model_layer,final_layernorm}}`); each depth's loss
  is logged as `mtp_{{k}} loss` (the mean of the micro-batches' means). With
  `--calculate-per-token-loss` a depth's loss is a token sum weighted `N / N_k` and normalized
  with the main loss (upstream's). Under pipeline parallelism the depths run on the last stage,
  which then holds a copy of the word embedding (`m` in `--pipeline-model-parallel-layout`,
  right before `L`); there it needs rotary positions, and untied output weights with
  `--use-mfsdp`. Not under context parallelism (refused); evaluation computes no MTP loss.
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
        if flags[0] in MAPPED or flags[0] in REJECTED:
            continue
        seen.add(flags[0])
        text = "" if action.help in (None, argparse.SUPPRESS) else action.help.replace("|", "/")
        honoured.append((" ".join(f"`{f}`" for f in flags), text))
    return honoured


def main():
    honoured = rows()
    out = [HEADER.format(honoured=len(honoured), mapped=len(MAPPED), rejected=len(REJECTED)),
           "## Honoured", "", "These change behaviour as they do in Megatron-LM.", "",
           "| flag | effect here |", "|---|---|"]
    out += [f"| {flags} | {text} |" for flags, text in honoured]
    out += ["", "## Mapped", "", "Accepted; the effect is the one described (a no-op where the behaviour is",
            "always on, or a synonym of one of our settings).", "", "| flag | here |", "|---|---|"]
    out += [f"| `{flag}` | {note} |" for flag, (_, note) in MAPPED.items()]
    out += ["", "`--use-distributed-optimizer` without `--use-mfsdp` (upstream's DDP + distributed optimizer)",
            "is in the honoured table: it runs MFSDP with `--data-parallel-sharding-strategy optim`",
            "(ZeRO-1: optimizer state sharded, gradients and parameters replicated).", "",
            "## Rejected", "", "Recognised and refused with this message; the run does not start.", "",
            "| flag | what to do |", "|---|---|"]
    out += [f"| `{flag}` | {message} |" for flag, message in REJECTED.items()]
    path = os.path.join(REPO, "docs", "megatron_flags.md")
    text = "\n".join(out) + "\n"
    if os.path.exists(path):
        with open(path) as f:
            # The replay counts are scripts/doc_figures.py's (--write updates them), not this page's.
            text = keep_figures(text, f.read())
    with open(path, "w") as f:
        f.write(text)
    print(f"{len(honoured)} honoured, {len(MAPPED)} mapped, {len(REJECTED)} rejected")


if __name__ == "__main__":
    main()
