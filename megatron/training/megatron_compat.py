"""Megatron-LM flags that this trainer maps onto its own behaviour, or rejects.

Upstream command lines carry many flags that select fused kernels, checkpoint backends or
parallelism this project does not have. Two kinds are handled here (docs/megatron_flags.md
lists them all, next to the flags ``arguments.py`` honours):

* **mapped**: accepted; their effect here is the documented one (a no-op where the
  behaviour is always on, or a synonym of one of our choices);
* **rejected**: known to Megatron but not implemented; parsing them fails with a message
  that names the flag and says what to use instead.

Anything else gets argparse's "unrecognized arguments", with a close match suggested.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Dict, List, Tuple

# flag -> (argparse keyword arguments, what it does here). Flags taking a value list
# their choices where upstream has them, so a typo in the value is still an error.
MAPPED: Dict[str, Tuple[dict, str]] = {
    "--use-mcore-models": (dict(action="store_true"), "always: the model is the Megatron-Core GPT"),
    "--overlap-grad-reduce": (dict(action="store_true"),
                              "always on: MFSDP reduces each unit's gradients during backward, DDP per bucket"),
    "--overlap-param-gather": (dict(action="store_true"),
                               "always on: MFSDP prefetches the next unit's parameters"),
    "--ckpt-format": (dict(choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"), default=None),
                      "this trainer's one format (DCP shards + common.json, docs/checkpointing.md)"),
    "--auto-detect-ckpt-format": (dict(action="store_true"), "there is one checkpoint format"),
    "--use-persistent-ckpt-worker": (dict(action="store_true"),
                                     "--async-save already writes from one long-lived background worker"),
    "--dist-ckpt-optim-fully-reshardable": (dict(action="store_true"),
                                            "always: checkpoints load at any world size"),
    "--ckpt-fully-parallel-save": (dict(action="store_true"), "always: every rank writes its own shard"),
    "--no-ckpt-fully-parallel-save": (dict(action="store_true"), "every rank still writes its own shard"),
    "--ckpt-fully-parallel-load": (dict(action="store_true"), "always: every rank reads its own shard"),
    "--ckpt-assume-constant-structure": (dict(action="store_true"), "no effect (no plan caching)"),
    "--use-dist-ckpt": (dict(action="store_true"), "always: the checkpoints are distributed (DCP)"),
    "--override-opt_param-scheduler": (dict(action="store_true"),
                                       "the default: the LR schedule comes from the command line"),
    "--use-flash-attn": (dict(action="store_true"), "same as --attention-backend flash"),
    "--no-create-attention-mask-in-dataloader": (dict(action="store_true"),
                                                 "always: the causal mask is built inside attention"),
    "--apply-query-key-layer-scaling": (dict(action="store_true"),
                                        "no effect: it rescales inside Megatron's fused fp16 softmax, "
                                        "the result is the same"),
    "--no-masked-softmax-fusion": (dict(action="store_true"), "no fused softmax kernel here"),
    "--moe-per-layer-logging": (dict(action="store_true"),
                                "always: the MoE metrics are logged per layer (moe/layer{n}/...) besides their means"),
    "--no-bias-gelu-fusion": (dict(action="store_true"), "no fused bias-GELU kernel here"),
    "--no-bias-swiglu-fusion": (dict(action="store_true"), "no fused bias-SwiGLU kernel here"),
    "--no-bias-dropout-fusion": (dict(action="store_true"), "no fused bias-dropout kernel here"),
    "--no-rope-fusion": (dict(action="store_true"), "no fused RoPE kernel here"),
    "--no-persist-layer-norm": (dict(action="store_true"), "no persistent LayerNorm kernel here"),
    "--cross-entropy-loss-fusion": (dict(action="store_true"),
                                    "no fused kernel: the loss is fp32 cross entropy either way"),
    "--cross-entropy-fusion-impl": (dict(choices=("native", "te"), default=None),
                                    "no fused kernel: the loss is fp32 cross entropy either way"),
    "--use-tp-pp-dp-mapping": (dict(action="store_true"),
                               "no effect on results: ranks are laid out TP innermost, then CP, DP, PP outermost"),
    "--no-async-tensor-model-parallel-allreduce": (dict(action="store_true"),
                                                   "always: the TP all-reduces run synchronously"),
    "--ddp-average-in-collective": (dict(action="store_true"), "always: gradients are averaged in the collective"),
    "--no-use-tokenizer-model-from-checkpoint-args": (
        dict(action="store_true"),
        "with --load, the tokenizer flags (or GPT-2's default) win over the checkpoint's recorded tokenizer, unchecked"),
    "--empty-unused-memory-level": (dict(type=int, choices=(0, 1, 2), default=0),
                                    "no effect: the caching allocator keeps its blocks"),
    "--log-learning-rate-to-tensorboard": (dict(action="store_true"), "always logged"),
    "--log-loss-scale-to-tensorboard": (dict(action="store_true"), "always logged with --fp16"),
    "--log-batch-size-to-tensorboard": (dict(action="store_true"), "always logged"),
    "--use-cpu-initialization": (dict(action="store_true"),
                                 "no effect: the model is built on CPU, then moved to its device"),
    "--async-strategy": (dict(choices=("nvrx", "mcore"), default=None),
                         "--async-save has one strategy here (a background writer thread); both values select it"),
    "--verify-integrity": (dict(action="store_true"),
                           "always: every checkpoint file's checksum is written at save and verified at load"),
    "--no-use-layer-wise-param-layout": (dict(action="store_true"),
                                         "no effect: upstream's choice of buffer layout for its layer-wise "
                                         "distributed Muon; here Muon gathers each matrix from MFSDP's rows"),
    "--test-mode": (dict(action="store_true"),
                    "upstream checks at every attention forward that the QK-layernorm weights agree across "
                    "data- and tensor-parallel ranks; here it turns on the weight-hash check across "
                    "data-parallel replicas every iteration (every replicated weight; TP pieces are not compared)"),
    "--no-check-for-nan-in-loss-and-grad": (dict(action="store_true"),
                                            "no NaN/Inf check of the loss under --rerun-mode validate_results/report_stats; "
                                            "a NaN/inf gradient still skips the step (counted in the log line)"),
}

# Flags that choose GPU kernels, CUDA graphs, offloading or communication overlap: the
# numbers do not depend on them, so they are accepted, and because a user may expect a
# speed-up they do not get, each one given is announced with one line at launch
# (``announce_mapped_flags``). Also in MAPPED (one table in the docs).
_SAME = " (same results)"
ANNOUNCED: Dict[str, Tuple[dict, str]] = {
    "--moe-permute-fusion": (dict(action="store_true"),
                             "no fused permute kernel here: tokens are sorted by expert with torch ops" + _SAME),
    "--moe-router-fusion": (dict(action="store_true"),
                            "no fused router kernel here: scores, top-k and aux losses are torch ops" + _SAME),
    "--overlap-moe-expert-parallel-comm": (
        dict(action="store_true"),
        "the expert-parallel all-to-all runs in line, not overlapped with another micro-batch's compute" + _SAME),
    "--delay-wgrad-compute": (dict(action="store_true"),
                              "weight gradients are computed in their layer's backward, not delayed to overlap "
                              "the expert-parallel all-to-all" + _SAME),
    "--moe-enable-deepep": (dict(action="store_true"),
                            "no DeepEP here: the flex dispatcher is the all-to-all dispatcher" + _SAME),
    "--moe-flex-dispatcher-backend": (dict(choices=("deepep", "hybridep", "ncclep"), default=None),
                                      "no DeepEP/HybridEP/NCCL-EP kernels here: the flex dispatcher is the "
                                      "all-to-all dispatcher" + _SAME),
    "--use-transformer-engine-op-fuser": (dict(action="store_true"),
                                          "no Transformer Engine op fuser: the local layers run unfused" + _SAME),
    "--cuda-graph-impl": (dict(choices=("none", "local", "transformer_engine", "full_iteration"), default=None),
                          "no CUDA graphs are captured: kernels are launched one by one" + _SAME),
    "--cuda-graph-modules": (dict(nargs="+", default=None),
                             "no CUDA graphs are captured: kernels are launched one by one" + _SAME),
    "--cuda-graph-warmup-steps": (dict(type=int, default=None),
                                  "no CUDA graphs are captured: kernels are launched one by one" + _SAME),
    "--enable-cuda-graph": (dict(action="store_true"),
                            "no CUDA graphs are captured: kernels are launched one by one" + _SAME),
    "--fine-grained-activation-offloading": (dict(action="store_true"),
                                             "activations stay in device memory (no offload to the host)" + _SAME),
    "--offload-modules": (dict(nargs="+", default=None),
                          "activations stay in device memory (no offload to the host)" + _SAME),
    "--defer-embedding-wgrad-compute": (dict(action="store_true"),
                                        "the output layer's weight gradient is computed in its own backward, "
                                        "not deferred to overlap the pipeline's communication" + _SAME),
    "--wgrad-deferral-limit": (dict(type=int, default=None),
                               "the output layer's weight gradient is computed in its own backward, not "
                               "deferred" + _SAME),
    "--overlap-param-gather-with-optimizer-step": (
        dict(action="store_true"),
        "the refreshed weights are gathered after the optimizer step (ZeRO-1/2, HFSDP) or per unit at its "
        "use (ZeRO-3), not overlapped with the step" + _SAME),
    "--muon-use-syrk": (dict(action="store_true"),
                        "no Triton SYRK kernel here: Muon's Gram matrices are plain matmuls" + _SAME),
    "--te-rng-tracker": (dict(action="store_true"),
                         "no Transformer Engine RNG tracker: dropout draws from torch's generators (it exists "
                         "upstream for CUDA graphs)"),
    "--async-ckpt-use-cpu-shm": (dict(action="store_true"),
                                 "--async-save stages the state in its own CPU memory; no shared-memory staging"),
    "--disable-bf16-reduced-precision-matmul": (dict(action="store_true"),
                                                "a cuBLAS setting (no reduced-precision reductions in bf16 GEMMs); "
                                                "no effect on CPU"),
    # Upstream's ModelOpt flags (megatron/post_training/arguments.py) in its GPT-OSS line;
    # only its ModelOpt model builder (--modelopt-enabled, refused here) reads them.
    "--enable-gpt-oss": (dict(action="store_true"),
                         "no effect, as upstream without --modelopt-enabled (its ModelOpt builder alone turns it "
                         "into GPT-OSS's YaRN RoPE); pass --position-embedding-type yarn and the --yarn-* flags "
                         "for that"),
    "--export-force-local-attention": (dict(action="store_true"),
                                       "always: attention is the local implementation (ModelOpt export's choice "
                                       "of local over TE attention)"),
}
MAPPED.update(ANNOUNCED)

# flag -> what to do instead. Registered so that they are recognised (and named in the
# error), whatever value follows them.
_FP8 = "FP8 training is not supported; use --bf16"
_TP = "overlapping tensor-parallel communication with compute is not supported yet; drop it"
REJECTED: Dict[str, str] = {
    "--tp-comm-overlap": _TP,
    "--tp-comm-overlap-cfg": _TP,
    "--fp8-format": _FP8,
    "--fp8-recipe": _FP8,
    "--fp8-param-gather": _FP8,
    "--first-last-layers-bf16": _FP8,
    "--use-legacy-models": "only the Megatron-Core GPT model exists; drop it",
    "--use-checkpoint-args": "pass the model flags explicitly (the checkpoint's common.json lists them)",
    "--log-straggler": "straggler detection is not implemented; drop it",
    "--straggler-minmax-count": "straggler detection is not implemented; drop it",
    "--log-progress": "not implemented; the iteration log line has the progress",
}
# ModelOpt (upstream's post-training family), e.g. in its train.sh.
_MODELOPT = "ModelOpt (quantization, distillation, export) is not built here; drop it"
REJECTED.update({flag: _MODELOPT for flag in (
    "--modelopt-enabled", "--export-te-mcore-model",
    # The rest of upstream's ModelOpt family (megatron/post_training/arguments.py): model
    # export, quantization and knowledge distillation from a teacher.
    "--export-model-type", "--export-legacy-megatron", "--export-default-te-spec", "--export-kv-cache-quant",
    "--export-real-quant-cfg", "--export-quant-cfg", "--export-kd-teacher-load", "--export-kd-teacher-model-config",
    "--export-kd-teacher-ckpt-format", "--export-kd-cfg", "--export-qk-l2-norm",
    "--export-moe-apply-probs-on-input", "--export-offline-model")})
# Upstream's DeepSeek sparse attention (--experimental-attention-variant dsa; the dsa_*
# fields of its TransformerConfig, their --no-/--disable- forms for those defaulting true).
_DSA = ("DeepSeek sparse attention (DSA: the lightning indexer choosing the top-k keys) is not built here; "
        "drop it")
REJECTED.update({flag: _DSA for flag in (
    "--dsa-indexer-n-heads", "--dsa-indexer-head-dim", "--dsa-indexer-topk", "--dsa-indexer-topk-freq",
    "--dsa-indexer-skip-topk-offset", "--dsa-indexer-loss-coeff", "--dsa-indexer-use-sparse-loss",
    "--dsa-kernel-backend", "--dsa-indexer-rope-interleaved", "--no-dsa-indexer-rotate-activation",
    "--disable-dsa-indexer-rotate-activation", "--no-dsa-indexer-scoring-relu", "--disable-dsa-indexer-scoring-relu",
    "--dsa-indexer-k-norm-epsilon", "--dsa-indexer-k-norm-fp32")})


class _Rejected(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        kwargs.update(nargs="?", default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not supported: {REJECTED[option_string]}.")


def add_megatron_compat_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron-LM flags mapped onto this trainer (docs/megatron_flags.md)")
    for flag, (kwargs, note) in MAPPED.items():
        g.add_argument(flag, help=f"mapped: {note}", **kwargs)
    g = parser.add_argument_group("Megatron-LM flags that are not supported")
    for flag in REJECTED:
        g.add_argument(flag, action=_Rejected, help=argparse.SUPPRESS)


def apply_megatron_compat(args: argparse.Namespace) -> None:
    """Turn synonyms into our settings. Runs before the rest of the validation, which
    then sees only our own flags."""
    if args.use_flash_attn and args.attention_backend == "auto":
        args.attention_backend = "flash"


def announced_flags_given(args: argparse.Namespace) -> List[str]:
    """The ANNOUNCED flags this command line set, each with its one line."""
    given = []
    for flag, (_, note) in ANNOUNCED.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value not in (None, False):
            given.append(f"{flag}: {note}.")
    return given


def suggest_flags(unknown: List[str], parser: argparse.ArgumentParser) -> str:
    """' (did you mean --x?)' hints for unrecognized flags, '' when nothing is close."""
    known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    flags = [token for token in unknown if token.startswith("--")]
    for token in flags:
        match = difflib.get_close_matches(token.split("=", 1)[0], known, n=1, cutoff=0.75)
        if match:
            hints.append(match[0] if len(flags) == 1 else f"{match[0]} for {token}")
    return f" (did you mean {', '.join(hints)}?)" if hints else ""
