"""Megatron-LM's context-parallel flags: parsing, parse-time checks, and the config they give.

``--context-parallel-size`` cp splits every sequence over cp ranks (the load-balanced
2*cp-chunk split of ``megatron/core/transformer/context_parallel.py``); ``--cp-comm-type``
picks how attention exchanges keys and values (one type, or one per layer as upstream);
``--hierarchical-context-parallel-sizes a p`` shapes "a2a+p2p". ``validate_context_parallel_size``
runs first (the data-parallel size depends on it), ``validate_context_parallel_args`` once
the model shape is final. Every violation is a one-line ValueError that says what to change.
"""

from __future__ import annotations

import argparse
import math

from megatron.core import parallel_state
from megatron.core.transformer.context_parallel import SUPPORTED_CP_COMM_TYPES


def add_context_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("context parallelism (Megatron-LM's flags)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="ranks that split each sequence (pp x tp x cp must divide the world)")
    g.add_argument("--cp-comm-type", nargs="+", default=["p2p"],
                   help=f"attention's exchange under CP: {', '.join(SUPPORTED_CP_COMM_TYPES)}; one type, or one "
                        "per layer")
    g.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=_size, default=None,
                   help="a2a size and p2p size (multiplying to the CP size) for --cp-comm-type a2a+p2p")


def _size(text: str) -> int:
    # Upstream's own test configurations also spell the list "[2 2]".
    return int(text.strip("[]"))


def validate_context_parallel_size(args: argparse.Namespace, world_size: int) -> None:
    cp, tp, pp = args.context_parallel_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if cp < 1:
        raise ValueError(f"--context-parallel-size must be at least 1, got {cp}.")
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"--tensor-model-parallel-size ({tp}) x --pipeline-model-parallel-size ({pp}) x --context-parallel-size "
            f"({cp}) must divide the world size ({world_size}); launch a multiple of {tp * pp * cp} ranks or pick "
            "smaller sizes."
        )


def validate_context_parallel_args(args: argparse.Namespace) -> None:
    """The sequence split, the communication types and their head splits (after the model
    shape and the TP/SP settings are final)."""
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    types = list(args.cp_comm_type)
    for comm_type in types:
        if comm_type not in SUPPORTED_CP_COMM_TYPES:
            raise ValueError(f"--cp-comm-type {comm_type!r} is not supported; use one of "
                             f"{', '.join(SUPPORTED_CP_COMM_TYPES)}.")
    if len(types) not in (1, args.num_layers):
        raise ValueError(f"--cp-comm-type lists {len(types)} types for {args.num_layers} layers; give one type for "
                         "all layers or one per layer.")
    sizes = args.hierarchical_context_parallel_sizes
    if sizes is not None and (len(sizes) != 2 or min(sizes) < 1 or math.prod(sizes) != cp):
        raise ValueError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} must be two sizes "
                         f"(a2a, p2p) whose product is --context-parallel-size ({cp}), e.g. "
                         f"--hierarchical-context-parallel-sizes {cp} 1.")
    if cp == 1:
        return
    if "a2a+p2p" in types and sizes is None:
        raise ValueError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (A x P = "
                         f"--context-parallel-size {cp}); pass them.")
    # The sequence is cut into 2*cp chunks; sequence parallelism then cuts the local
    # sequence (S / cp tokens) over TP, in chunk pairs of equal length.
    multiple = 2 * cp * (tp if args.sequence_parallel else 1)
    if args.seq_length % multiple:
        what = "2 x --context-parallel-size" + (" x --tensor-model-parallel-size (sequence parallel)"
                                                 if args.sequence_parallel else "")
        raise ValueError(f"--seq-length ({args.seq_length}) must be divisible by {what} = {multiple}; use "
                         f"--seq-length {-(-args.seq_length // multiple) * multiple}.")
    heads, groups = args.num_attention_heads // tp, args.num_query_groups // tp
    for comm_type, size in (("a2a", cp), ("a2a+p2p", sizes[0] if sizes else 1)):
        if comm_type in types and (heads % size or groups % size):
            raise ValueError(f"--cp-comm-type {comm_type} scatters heads over {size} ranks: attention heads ({heads}) "
                             f"and query groups ({groups}) per TP rank must be divisible by {size}; use p2p or "
                             "all_gather.")
    if getattr(args, "num_experts", None):
        # Each CP rank routes its own 2 chunks: what depends on which tokens a rank holds
        # would change with the CP size (the counts of the losses are summed over CP instead).
        if getattr(args, "moe_expert_capacity_factor", None) is not None:
            raise ValueError("--moe-expert-capacity-factor with --context-parallel-size > 1 is not supported: each CP "
                             "rank routes its own chunks, so capacity would be per chunk; drop the capacity factor "
                             "or use --context-parallel-size 1.")


def context_parallel_config_kwargs(args) -> dict:
    """TransformerConfig's CP fields, with the groups from ``megatron.core.parallel_state``."""
    cp = getattr(args, "context_parallel_size", 1)
    types = list(getattr(args, "cp_comm_type", None) or ["p2p"])
    if cp == 1 or not parallel_state.model_parallel_is_initialized():
        return {}  # a tool reading a CP checkpoint in one process runs whole sequences
    state = parallel_state.get_parallel_state()
    return dict(context_parallel_size=cp, cp_group=state.cp_group,
                cp_comm_type=types[0] if len(types) == 1 else types,
                hierarchical_cp_groups=state.hierarchical_cp_groups)
