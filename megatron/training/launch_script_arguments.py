"""Flags that upstream Megatron-LM's ``examples/`` launch scripts pass (Llama-3 8B FP8,
Megatron-FSDP's Llama-3 and DeepSeek-V3 scripts, Mixtral, the SC21 paper's scripts), with
upstream's names and meanings. scripts/replay_upstream_examples.py replays those scripts.

* ``--grad-reduce-in-bf16``: with ``--bf16``, gradients are reduced in bf16 and accumulated
  into fp32 ``main_grad`` (the engine's ``MixedPrecisionPolicy.grad_comm_dtype``).
* Megatron-FSDP's buffer flags name CUDA allocator / NCCL mechanisms: accepted with one note.
* ``--tiktoken-*``, ``--tokenizer-special-tokens``: the TikTokenizer's options; without ``--tokenizer-type TikTokenizer``
  upstream ignores them (its Llama-3 scripts pass ``--tiktoken-pattern v2`` with NullTokenizer).
* The SC21 scripts' 2021 flags: ``--DDP-impl`` and ``--activations-checkpoint-method``.
* The GPT-OSS script's: ``--recompute-activations`` (upstream's old name of selective
  recompute), ``--accumulate-allreduce-grads-in-fp32`` (this trainer's default),
  ``--rope-type`` (upstream reads it for multi-latent attention only).
"""

from __future__ import annotations

import argparse
import os

import torch

from megatron.core.tokenizer.tiktoken_tokenizer import DEFAULT_VOCAB_SIZE, SPECIAL_TOKENS

TIKTOKEN_PATTERNS = ("v1", "v2")


def add_launch_script_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("upstream launch scripts")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: reduce gradients in bf16 (accumulated into fp32 main_grad)")
    g.add_argument("--fsdp-double-buffer", action="store_true",
                   help="Megatron-FSDP's two alternating all-gather buffers; here each unit's gather is "
                        "allocated at unshard and freed at reshard with one unit prefetched (see the note)")
    g.add_argument("--fsdp-manual-registration", action="store_true",
                   help="Megatron-FSDP's manual NCCL user-buffer registration: no effect on CPU (gloo)")
    g.add_argument("--use-nccl-ub", action="store_true",
                   help="NCCL user-buffer registration of the data-parallel buffers: no effect on CPU (gloo)")
    g.add_argument("--fsdp-db-use-persist-buf-on-alloc-fail", action="store_true",
                   help="with --fsdp-double-buffer: no effect (there is no fixed buffer to run out of)")
    g.add_argument("--tiktoken-pattern", choices=TIKTOKEN_PATTERNS, default=None,
                   help="TikTokenizer's pre-tokenization regex: v1 or v2 (upstream's)")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer: ids reserved below the BPE ranks for special tokens")
    g.add_argument("--tokenizer-special-tokens", dest="special_tokens", nargs="+", default=None,
                   help="TikTokenizer: the special tokens (the first ids; must include <unk> <s> </s> <mask> "
                        "<pad> <cls> <sep>, upstream's default list)")
    g.add_argument("--profile", action="store_true",
                   help="profile steps [--profile-step-start, --profile-step-end) on --profile-ranks "
                        "(megatron/training/profiling.py)")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="with --profile: a PyTorch profiler trace in --tensorboard-dir (else, on CUDA, an nsys "
                        "capture range)")
    g.add_argument("--profile-step-start", type=int, default=10, help="the first profiled step (0-based)")
    g.add_argument("--profile-step-end", type=int, default=12, help="the step after the last profiled one")
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0], help="global ranks that profile")
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="route tokens by random logits (upstream's benchmark mode for balanced expert load)")
    g.add_argument("--enable-experimental", action="store_true",
                   help="upstream's switch for its experimental features; nothing here is gated behind it")
    g.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false",
                   help="deprecated upstream: only with --position-embedding-type rope, where it changes nothing")
    g.add_argument("--DDP-impl", dest="ddp_impl", choices=("local", "torch"), default=None,
                   help="2021 Megatron's DDP choice: both run as this trainer's data parallelism")
    g.add_argument("--recompute-activations", action="store_true",
                   help="upstream's old name of --recompute-granularity selective")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="gradients accumulated and reduced in fp32: this trainer's default")
    g.add_argument("--rope-type", choices=("rope", "yarn"), default=None,
                   help="upstream's RoPE kind for multi-latent attention (plain RoPE here); other models take "
                        "--position-embedding-type")
    g.add_argument("--activations-checkpoint-method", choices=("uniform", "block"), default=None,
                   help="2021 Megatron's name of --recompute-method (full-layer recomputation)")


def apply_launch_script_synonyms(args: argparse.Namespace, note) -> None:
    """Old names for current flags; resolved before the recompute flags are validated."""
    if args.activations_checkpoint_method is not None:
        if args.recompute_method not in (None, args.activations_checkpoint_method):
            raise ValueError("--activations-checkpoint-method is the old name of --recompute-method; pass one of them.")
        args.recompute_method = args.activations_checkpoint_method
        if args.recompute_granularity is None:
            args.recompute_granularity = "full"  # the 2021 flag recomputed whole layers
    if args.recompute_activations:
        if args.recompute_granularity not in (None, "selective"):
            raise ValueError("--recompute-activations is upstream's old name of --recompute-granularity selective; "
                             f"it contradicts --recompute-granularity {args.recompute_granularity}: pass one of them.")
        args.recompute_granularity = "selective"
    if args.ddp_impl is not None:
        note(f"--DDP-impl {args.ddp_impl}: 2021 Megatron's choice of DDP wrapper; gradients are averaged "
             "over data-parallel ranks by this trainer's DDP (or MFSDP with --use-mfsdp) either way.")


def validate_launch_script_args(args: argparse.Namespace, note) -> None:
    """After the data-parallel dtypes are set (``args.grad_comm_dtype``)."""
    if args.grad_reduce_in_bf16:
        if not args.bf16:
            # Upstream reads the flag only under --bf16.
            note("--grad-reduce-in-bf16 has no effect without --bf16: gradients are reduced in fp32.")
        elif not args.use_mfsdp:
            note("--grad-reduce-in-bf16 under DDP: gradients are reduced in fp32 (autocast keeps fp32 weights); "
                 "add --use-mfsdp (or --use-distributed-optimizer) to reduce them in bf16.")
        elif args.megatron_fsdp_grad_comm_dtype not in (None, "auto", "bf16"):
            raise ValueError(f"--grad-reduce-in-bf16 with --megatron-fsdp-grad-comm-dtype "
                             f"{args.megatron_fsdp_grad_comm_dtype}: pass one of them.")
        else:
            args.grad_comm_dtype = torch.bfloat16
    if args.fsdp_double_buffer:
        note("--fsdp-double-buffer: MFSDP allocates each unit's gathered parameters at unshard and frees them at "
             "reshard, one unit prefetched, so at most two units' gathers are alive and the allocator reuses "
             "their blocks; there are no separate fixed buffers."
             + (" With --megatron-fsdp-no-reshard-after-forward each chunk's units all stay gathered through the "
                "step instead." if not getattr(args, "megatron_fsdp_reshard_after_forward", True) else ""))
    registration = [flag for flag, on in (("--use-nccl-ub", args.use_nccl_ub),
                                          ("--fsdp-manual-registration", args.fsdp_manual_registration)) if on]
    if registration:
        note(f"{' and '.join(registration)}: NCCL user-buffer registration is CUDA-only; the buffers are "
             "ordinary allocations here (same results).")
    if args.accumulate_allreduce_grads_in_fp32 and (args.grad_reduce_in_bf16 or args.main_grads_dtype != torch.float32):
        raise ValueError("--accumulate-allreduce-grads-in-fp32 contradicts --grad-reduce-in-bf16 / a non-fp32 "
                         "--megatron-fsdp-main-grads-dtype; pass one of them.")
    if args.rope_type == "yarn" and args.position_embedding_type != "yarn":
        if getattr(args, "multi_latent_attention", False):
            raise ValueError("--rope-type yarn with --multi-latent-attention: MLA's rotary part is plain RoPE here; "
                             "drop it or pass --rope-type rope.")
        note("--rope-type yarn has no effect here (upstream reads it for multi-latent attention only): the position "
             "embedding is --position-embedding-type's; pass --position-embedding-type yarn for YaRN.")
    _validate_profile(args, note)
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        # Upstream refuses it the same way (there is no 'no position embedding' type).
        raise ValueError("--no-position-embedding is deprecated; use --position-embedding-type rope (or drop it).")
    if args.tokenizer_type != "TikTokenizer" and args.special_tokens is not None:
        note(f"--tokenizer-special-tokens has no effect with --tokenizer-type {args.tokenizer_type}.")


def _validate_profile(args: argparse.Namespace, note) -> None:
    if not args.profile:
        if args.use_pytorch_profiler:
            note("--use-pytorch-profiler has no effect without --profile.")
        return
    if not 0 <= args.profile_step_start < args.profile_step_end:
        raise ValueError(f"--profile-step-start ({args.profile_step_start}) must be >= 0 and below "
                         f"--profile-step-end ({args.profile_step_end}).")
    bad = [r for r in args.profile_ranks if not 0 <= r < args.world_size]
    if bad:
        raise ValueError(f"--profile-ranks {bad} are outside the world of {args.world_size} ranks; pass ranks "
                         f"0..{args.world_size - 1}.")
    if args.use_pytorch_profiler and args.tensorboard_dir is None:
        raise ValueError("--use-pytorch-profiler writes its trace into --tensorboard-dir; add --tensorboard-dir DIR.")
    if not args.use_pytorch_profiler and args.device_type != "cuda":
        where = (f"a PyTorch profiler trace into {args.tensorboard_dir}" if args.tensorboard_dir
                 else "nothing (add --tensorboard-dir DIR for a PyTorch profiler trace)")
        note("--profile without --use-pytorch-profiler is an nsys capture range (CUDA profiler start/stop); "
             f"without CUDA, steps {args.profile_step_start}..{args.profile_step_end - 1} record {where}.")


def validate_tiktoken_args(args: argparse.Namespace) -> None:
    """--tokenizer-type TikTokenizer: the file and the id layout (the tokenizer itself is built
    after parsing; these are the checks that need no file contents)."""
    import importlib.util  # only for this check

    path = args.tokenizer_model
    if not path or not path.endswith(".json") or not os.path.isfile(path):
        raise ValueError(f"--tokenizer-type TikTokenizer needs --tokenizer-model FILE.json (upstream's tiktoken "
                         f"tokenizer file); got {path!r}.")
    if importlib.util.find_spec("tiktoken") is None:
        raise ValueError("--tokenizer-type TikTokenizer needs the tiktoken package: pip install tiktoken.")
    special = args.special_tokens or SPECIAL_TOKENS
    vocab_size = args.vocab_size or DEFAULT_VOCAB_SIZE
    if not len(special) <= args.tiktoken_num_special_tokens < vocab_size:
        raise ValueError(f"--tiktoken-num-special-tokens ({args.tiktoken_num_special_tokens}) must be at least the "
                         f"{len(special)} special tokens and below the vocabulary size ({vocab_size}, --vocab-size).")
    missing = [t for t in SPECIAL_TOKENS if t not in special]
    if missing:
        raise ValueError(f"--tokenizer-special-tokens must include {' '.join(SPECIAL_TOKENS)}; missing "
                         f"{' '.join(missing)}.")
