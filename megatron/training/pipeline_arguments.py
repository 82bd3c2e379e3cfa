"""Megatron-LM's pipeline-parallel flags: parsing, parse-time checks, and the layout they give.

The flags keep Megatron's names and meanings. ``validate_pipeline_size`` runs first (the
data-parallel size depends on it); ``validate_pipeline_args`` once the model shape and the
number of microbatches are known. Every violation is a ValueError that says what to change.
"""

from __future__ import annotations

import argparse

from megatron.core.pipeline_parallel.layout import PipelineLayout, build_pipeline_layout, parse_layout_string
from megatron.core.pipeline_parallel.schedules import pipeline_order


def add_pipeline_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pipeline parallelism (Megatron-LM's flags)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages; the model's layers are split over them (pp x tp x cp must divide the world)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per model chunk; a rank then holds several chunks (interleaved schedule)")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="model chunks per pipeline rank (interleaved schedule)")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   dest="num_virtual_stages_per_pipeline_rank_legacy",
                   help="older name of --num-virtual-stages-per-pipeline-rank")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="transformer layers of the first pipeline stage (the others share the rest evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="transformer layers of the last pipeline stage")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as one layer of the first stage when splitting evenly")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the loss as one layer of the last stage when splitting evenly")
    g.add_argument("--pipeline-model-parallel-layout", type=str, default=None,
                   help="explicit layout, chunks separated by '|': E embedding, t layer, m MTP depth, L loss, "
                        "e.g. 'Et|(tt|)*2tL'")
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
                   help="consecutive microbatches per model chunk in the interleaved schedule (default: the PP size)")
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
                   help="accepted: receives are always posted one step ahead, on their own streams")
    g.add_argument("--overlap-p2p-communication-warmup-flush", action="store_true",
                   help="accepted: receives are always posted one step ahead, warmup and flush included")


def validate_pipeline_size(args: argparse.Namespace, world_size: int) -> None:
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    if pp < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be at least 1, got {pp}.")
    if world_size % (tp * pp):
        raise ValueError(
            f"--tensor-model-parallel-size ({tp}) x --pipeline-model-parallel-size ({pp}) must divide the world size "
            f"({world_size}); launch a multiple of {tp * pp} ranks or pick smaller sizes."
        )


def validate_pipeline_args(args: argparse.Namespace) -> None:
    """Virtual stages, the layer split and the schedule's microbatch rules (after the batch
    sizes are known). Sets ``args.virtual_pipeline_model_parallel_size`` (None: one chunk)."""
    pp = args.pipeline_model_parallel_size
    if args.num_virtual_stages_per_pipeline_rank_legacy is not None:
        if args.num_virtual_stages_per_pipeline_rank not in (None, args.num_virtual_stages_per_pipeline_rank_legacy):
            raise ValueError("--virtual-pipeline-model-parallel-size and --num-virtual-stages-per-pipeline-rank "
                             "disagree; pass only --num-virtual-stages-per-pipeline-rank.")
        args.num_virtual_stages_per_pipeline_rank = args.num_virtual_stages_per_pipeline_rank_legacy
    ways = [f for f, v in (("--num-layers-per-virtual-pipeline-stage", args.num_layers_per_virtual_pipeline_stage),
                           ("--num-virtual-stages-per-pipeline-rank", args.num_virtual_stages_per_pipeline_rank),
                           ("--pipeline-model-parallel-layout", args.pipeline_model_parallel_layout))
            if v is not None]
    uneven = args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
    split_flags = [f for f, v in (("--decoder-first-pipeline-num-layers", args.decoder_first_pipeline_num_layers),
                                  ("--decoder-last-pipeline-num-layers", args.decoder_last_pipeline_num_layers),
                                  ("--account-for-embedding-in-pipeline-split",
                                   args.account_for_embedding_in_pipeline_split or None),
                                  ("--account-for-loss-in-pipeline-split",
                                   args.account_for_loss_in_pipeline_split or None),
                                  ("--microbatch-group-size-per-virtual-pipeline-stage",
                                   args.microbatch_group_size_per_virtual_pipeline_stage)) if v is not None]
    if pp == 1:
        given = ways + split_flags
        if given:
            raise ValueError(f"{', '.join(given)} need --pipeline-model-parallel-size > 1; drop "
                             f"{'it' if len(given) == 1 else 'them'} or set a pipeline size.")
        args.virtual_pipeline_model_parallel_size = None
        return
    if len(ways) > 1:
        raise ValueError(f"pass at most one of {', '.join(ways)}: each sets the number of virtual stages.")
    if args.pipeline_model_parallel_layout is not None:
        if uneven or args.account_for_embedding_in_pipeline_split or args.account_for_loss_in_pipeline_split:
            raise ValueError("--pipeline-model-parallel-layout places every layer itself; drop the "
                             "--decoder-first/last-pipeline-num-layers and --account-for-* flags.")
        chunks = len(parse_layout_string(args.pipeline_model_parallel_layout))
        if chunks % pp:
            raise ValueError(f"--pipeline-model-parallel-layout has {chunks} chunks, not a multiple of "
                             f"--pipeline-model-parallel-size ({pp}).")
        vp = chunks // pp
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        if uneven:
            raise ValueError("with --decoder-first/last-pipeline-num-layers give the virtual stages as "
                             "--num-virtual-stages-per-pipeline-rank, not --num-layers-per-virtual-pipeline-stage.")
        per_chunk = args.num_layers_per_virtual_pipeline_stage
        total = args.num_layers + int(args.account_for_embedding_in_pipeline_split) + \
            int(args.account_for_loss_in_pipeline_split)
        if per_chunk < 1 or total % pp or (total // pp) % per_chunk:
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage ({per_chunk}) must divide the layers per pipeline stage "
                f"({total} / {pp}); pick a divisor of {total // pp if total % pp == 0 else 'a whole stage size'}."
            )
        vp = total // pp // per_chunk
    else:
        vp = args.num_virtual_stages_per_pipeline_rank or 1
        if vp < 1:
            raise ValueError(f"--num-virtual-stages-per-pipeline-rank must be at least 1, got {vp}.")
    # One virtual stage is the 1F1B schedule, where a microbatch group size means nothing
    # (upstream ignores it too: its command lines pass it with one virtual stage).
    args.virtual_pipeline_model_parallel_size = vp if vp > 1 else None
    pipeline_layout_from_args(args)  # every layer-split error, now
    if vp > 1:
        pipeline_order(args.num_microbatches, pp, 0, vp, args.microbatch_group_size_per_virtual_pipeline_stage)


def pipeline_layout_from_args(args: argparse.Namespace) -> PipelineLayout:
    """The global layers of every (pipeline rank, virtual stage)."""
    return build_pipeline_layout(
        args.num_layers, getattr(args, "pipeline_model_parallel_size", 1),
        getattr(args, "virtual_pipeline_model_parallel_size", None) or 1,
        first_stage_layers=getattr(args, "decoder_first_pipeline_num_layers", None),
        last_stage_layers=getattr(args, "decoder_last_pipeline_num_layers", None),
        account_for_embedding=getattr(args, "account_for_embedding_in_pipeline_split", False),
        account_for_loss=getattr(args, "account_for_loss_in_pipeline_split", False),
        layout=getattr(args, "pipeline_model_parallel_layout", None),
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
    )
