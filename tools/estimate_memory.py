#!/usr/bin/env python
"""Per-rank memory and communication of every data-parallel strategy, before training.

    python tools/estimate_memory.py --world-size 4 --num-layers 24 --hidden-size 2048 \
        --num-attention-heads 16 --seq-length 1024 --micro-batch-size 1 --global-batch-size 8 \
        --tokenizer-type NullTokenizer --vocab-size 50257

Takes pretrain_gpt.py's own flags (parsed and validated by the trainer's parser) and the
world size; the flags only training needs (``--lr``, ``--train-iters``) may be left out
(they change no byte of the plan), so a training command's flags paste in as they are; builds the model on the meta device (no memory) and prints, per strategy
(DDP, ZeRO-1/2/3, HSDP, HFSDP) and per rank, the persistent bytes, the transient peak
and the bytes sent per step by collective kind (tools/memory_planner/estimate.py).

With ``--tensor-model-parallel-size`` or ``--expert-model-parallel-size`` above 1 the
model is one rank's: its TP-local shapes (the experts' too) and its E/EP experts, laid
out over the expert-data-parallel ranks (two levels with HSDP/HFSDP: the dense replicas,
each of world / TP / replicas / EP ranks). With TP the bytes per step include a MoE
layer's TP regions (tokens, router probabilities, under SP the routing map and the router
losses); MoE with TP and full recompute is refused. The model provider takes
real process groups of those sizes (and the trainer's checks on them); here they come
from torch's in-process "fake" backend (a world of --world-size ranks whose collectives
do nothing), so no other process is started.

With ``--context-parallel-size`` C the dense units are laid out over DP x C ranks (the
engine shards over the CP ranks too), each rank's activations are those of its S / C
tokens with the attention core of ``--cp-comm-type``, and the plan adds the exchange's
transient K/V buffers (``cp_buffers``, in the peak) and bytes (``cp_*``).

With ``--pipeline-model-parallel-size`` P each stage gets its own table: its chunks'
units (the stage's layers, the first stage's embedding, the last stage's output layer,
a tied embedding's copy on both), laid out over world / (TP x P) ranks, and the
activations of the microbatches its schedule holds at once: ``min(P - stage, m)`` under
1F1B, ``min(2 (P - stage - 1) + (v - 1) g + 1, v m)`` chunk-microbatches of one chunk's
layers under the interleaved schedule (g: the microbatch group size).
"""

import argparse
import contextlib
import dataclasses
import os
import sys

_REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import torch  # noqa: E402

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def planned_units(model):
    """The units ``model_builder.build_model`` wraps, in its order: per layer its experts
    (a MoE layer's, sharded over the expert-data-parallel mesh) then the layer; the root last."""
    from tools.memory_planner.estimate import units_of
    from megatron.core.tensor_parallel import tensor_parallel_parameters
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron.training.model_builder import tied_embedding_module

    modules, experts = [], []
    for layer in model.decoder.layers:
        if isinstance(getattr(layer, "mlp", None), MoELayer):
            modules.append(layer.mlp.experts)
            experts.append(layer.mlp.experts)
        modules.append(layer)
    pipeline_chunk = not (getattr(model, "pre_process", True) and getattr(model, "post_process", True))
    tied = tied_embedding_module(model) if pipeline_chunk else None
    if tied is not None:  # its own unit on the first and last stage (model_builder.build_model)
        modules.append(tied)
    return units_of(model, modules + [model], expert_modules=experts, tp_split=tensor_parallel_parameters(model))


def needs_process_groups(args) -> bool:
    ep = args.expert_model_parallel_size if args.num_experts else 1
    return args.tensor_model_parallel_size > 1 or ep > 1 or args.pipeline_model_parallel_size > 1


@contextlib.contextmanager
def planning_world(args, world_size: int, stage: int = 0):
    """The first rank of pipeline stage ``stage`` in a ``world_size``-rank fake world with
    the trainer's parallel state, when the model needs process groups (TP, EP or PP > 1);
    nothing otherwise."""
    if not needs_process_groups(args):
        yield
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron.core import parallel_state

    rank = stage * (world_size // args.pipeline_model_parallel_size)  # PP is the outermost axis
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        parallel_state.initialize_model_parallel(
            args.tensor_model_parallel_size, args.dp_outer_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size if args.num_experts else None,
            context_parallel_size=getattr(args, "context_parallel_size", 1),
            hierarchical_context_parallel_sizes=getattr(args, "hierarchical_context_parallel_sizes", None))
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def model_units(args, world_size: int, stage: int = 0):
    """(units of one rank's model (of pipeline stage ``stage``) as the trainer would build
    it, ActivationShape of one of its chunks' microbatch, MoEShape or None), without memory."""
    from megatron.training.model_builder import pipeline_chunk_kwargs
    from megatron.training.training import build_tokenizer_from_args
    from pretrain_gpt import model_provider

    build_tokenizer_from_args(args)
    with planning_world(args, world_size, stage), torch.device("meta"):
        chunks = [model_provider(args, **kwargs) for kwargs in pipeline_chunk_kwargs(args)]
    units = [u for chunk in chunks for u in planned_units(chunk)]
    shape, moe = shapes_of(args, chunks[0])
    if args.pipeline_model_parallel_size > 1:
        # One chunk's layers per microbatch in flight; the logits only where the loss is.
        last = any(chunk.post_process for chunk in chunks)
        shape = dataclasses.replace(shape, num_layers=max(len(chunk.decoder.layers) for chunk in chunks),
                                    vocab_size=shape.vocab_size if last else 0)
    return units, shape, moe


def activations_in_flight(args, stage: int) -> int:
    """Microbatches (of one chunk) whose activations a pipeline stage holds at once."""
    p, m = args.pipeline_model_parallel_size, args.num_microbatches
    v = args.virtual_pipeline_model_parallel_size or 1
    if v == 1:
        return min(p - stage, m)
    group = args.microbatch_group_size_per_virtual_pipeline_stage or p
    return min(2 * (p - stage - 1) + (v - 1) * group + 1, v * m)


def shapes_of(args, model):
    """(ActivationShape, MoEShape or None) of one microbatch of ``model`` built for ``args``."""
    from tools.memory_planner.estimate import ActivationShape, MoEShape
    from megatron.core.transformer.moe.model_queries import moe_layers

    layers, routed = model.decoder.layers, {id(m) for m in moe_layers(model)}
    recomputed, chunk_ends = [], []  # under full recompute (TransformerBlock's chunks)
    if args.recompute_granularity == "full":
        start = 0
        for size, checkpointed in model.decoder.recompute_chunks():
            if checkpointed:
                recomputed += list(layers[start:start + size])
                chunk_ends.append(layers[start + size - 1])
            start += size
    is_moe = [id(layer.mlp) in routed for layer in chunk_ends]
    cp = getattr(args, "context_parallel_size", 1)
    # Under CP a rank holds S / CP tokens of each sequence; the attention core sees them all.
    shape = ActivationShape(args.micro_batch_size, args.seq_length // cp, args.hidden_size, args.num_attention_heads,
                            args.ffn_hidden_size, args.num_layers, args.padded_vocab_size,
                            element_bytes=2 if args.bf16 else 4, tp_size=args.tensor_model_parallel_size,
                            sequence_parallel=args.sequence_parallel, recomputed_layers=len(recomputed),
                            recomputed_dense_chunk_ends=is_moe.count(False), hidden_dropout=args.hidden_dropout,
                            gated_mlp=args.swiglu, cp_size=cp,
                            cp_comm_types=tuple(getattr(args, "cp_comm_type", None) or ("p2p",)),
                            cp_a2a_size=(getattr(args, "hierarchical_context_parallel_sizes", None) or [0])[0],
                            num_query_groups=args.num_query_groups or args.num_attention_heads)
    moe = None
    if args.num_experts:
        router_bytes = {None: None, "fp32": 4, "fp64": 8}[args.moe_router_dtype]
        losses = args.moe_router_load_balancing_type == "aux_loss"
        moe = MoEShape(len(routed), args.num_experts, args.moe_router_topk, args.expert_model_parallel_size,
                       recomputed_moe_layers=sum(id(layer.mlp) in routed for layer in recomputed),
                       router_bytes=router_bytes, shared_expert_ffn=args.moe_shared_expert_intermediate_size or 0,
                       aux_loss=losses and args.moe_aux_loss_coeff > 0, z_loss=bool(args.moe_z_loss_coeff),
                       ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size, gated=args.swiglu,
                       biased=args.add_bias_linear)
    return shape, moe


def estimate(args, world_size: int, outer_size: int, stage: int = 0):
    """Plans of every strategy that fits ``world_size`` ranks, each over the data-parallel
    size world / (TP x PP) (DP x CP: the engine shards over the CP ranks too) (hybrids need outer_size | that, and with experts EP | the
    instance's size), for pipeline stage ``stage``."""
    from tools.memory_planner.estimate import STRATEGIES, plan

    units, shape, moe = model_units(args, world_size, stage)
    dp = world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    in_flight = activations_in_flight(args, stage) if args.pipeline_model_parallel_size > 1 else 1
    compute = 2 if args.bf16 else 4
    grads = _BYTES[args.main_grads_dtype] if args.main_grads_dtype is not None else compute
    comm = _BYTES[args.grad_comm_dtype] if args.grad_comm_dtype is not None else grads
    plans = []
    for strategy in STRATEGIES:
        hybrid = strategy in ("hsdp", "hfsdp")
        if hybrid and (outer_size < 2 or dp % outer_size or (moe is not None and (dp // outer_size) % moe.ep_size)):
            continue
        if strategy == "ddp" and moe is not None and moe.ep_size > 1:
            continue  # DDP would average different experts (the trainer refuses it)
        # HFSDP's outer shards differ between ranks: report the largest.
        ranks = range(dp) if strategy == "hfsdp" else [0]
        candidates = [
            plan(units, strategy, dp, outer_size=outer_size if hybrid else 1,
                 microbatches=args.num_microbatches, compute_bytes=compute, grad_bytes=grads, comm_bytes=comm,
                 rank=r, activations=shape, moe=moe, activations_in_flight=in_flight)
            for r in ranks
        ]
        plans.append(max(candidates, key=lambda p: p.persistent_total))
    return units, plans


# The trainer requires a learning rate and a run length; neither changes a byte of the plan.
# A run length far past any warmup, so that --lr-warmup-iters alone stays valid.
_PLANNING_DEFAULTS = {"lr": 1e-4, "train_iters": 10**9}


def _planning_defaults(argv) -> dict:
    """The defaults of the training-only flags ``argv`` leaves out (a run given in samples
    keeps --train-samples alone: the trainer refuses both lengths at once)."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    defaults = dict(_PLANNING_DEFAULTS)
    if given & {"--train-iters", "--train-samples"}:
        del defaults["train_iters"]
    return defaults


def main(argv=None):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--world-size", type=int, required=True, help="number of ranks (TP x data-parallel)")
    pre.add_argument("--outer-size", type=int, default=None,
                     help="replicas for HSDP/HFSDP (default --num-distributed-optimizer-instances, else 2)")
    known, rest = pre.parse_known_args(argv)
    if known.world_size < 1:
        raise SystemExit("estimate_memory.py: error: --world-size must be at least 1.")
    from tools.memory_planner.estimate import format_plans
    from megatron.training.arguments import parse_args

    try:
        args = parse_args(rest, args_defaults=_planning_defaults(rest), world_size=known.world_size,
                          cuda_available=False)
    except ValueError as error:
        raise SystemExit(f"estimate_memory.py: error: {error}")
    import torch.distributed as dist

    if args.num_experts and args.tensor_model_parallel_size > 1 and args.recompute_granularity == "full":
        # Which of a recomputed MoE layer's TP collectives run again is not modelled.
        raise SystemExit("estimate_memory.py: error: plans of a mixture of experts with "
                         "--tensor-model-parallel-size > 1 and full recompute are not supported yet; "
                         "plan it without --recompute-granularity full.")
    if args.num_experts and (args.expert_tensor_parallel_size or args.tensor_model_parallel_size) != \
            args.tensor_model_parallel_size:
        # The expert units over (stage / (EP x ETP)) ranks and the token path's collectives
        # (moe_layer.py) are not modelled yet.
        raise SystemExit("estimate_memory.py: error: plans with --expert-tensor-parallel-size other than "
                         "--tensor-model-parallel-size are not supported yet; plan with the experts split like the "
                         "dense layers (drop --expert-tensor-parallel-size).")
    if args.optimizer == "muon":
        # The optimizer state is planned as Adam's two states per weight; Muon keeps one for
        # its matrices and gathers each matrix's update for a step.
        raise SystemExit("estimate_memory.py: error: plans with --optimizer muon are not supported yet (the planner "
                         "counts Adam's two states per weight); plan with --optimizer adam for an upper bound.")
    if getattr(args, "experimental_attention_variant", None):
        # The weights would be counted (the model is built), but the activation model
        # knows softmax attention only, not the gated delta net's chunked recurrence.
        raise SystemExit("estimate_memory.py: error: plans with --experimental-attention-variant (gated delta-net "
                         "layers) are not supported yet (their activations are not modelled); plan the model "
                         "without it, or measure a short run.")
    if getattr(args, "mtp_num_layers", None):
        raise SystemExit("estimate_memory.py: error: plans with --mtp-num-layers are not supported yet (the MTP "
                         "depths' activations are not modelled); plan without it.")
    if args.recompute_granularity == "selective" and args.recompute_modules != ["core_attn"]:
        # The activation model knows selective recompute of the attention core only.
        raise SystemExit("estimate_memory.py: error: plans with --recompute-modules other than core_attn are not "
                         "supported yet; plan without --recompute-modules.")
    if args.pipeline_model_parallel_size > 1 and (args.num_experts or args.recompute_granularity == "full"):
        # Which stage holds which MoE layers' traffic, and full recompute's chunks per
        # stage, are not modelled yet.
        raise SystemExit("estimate_memory.py: error: pipeline plans of a mixture of experts or with full recompute "
                         "are not supported yet; plan at --pipeline-model-parallel-size 1, or without them.")
    if needs_process_groups(args) and dist.is_initialized():
        # The planning world is a process group of its own; this process already has one.
        raise SystemExit("estimate_memory.py: error: plans with TP or EP > 1 build the model in a fake world; "
                         "run the tool as a plain process (not under torchrun).")
    outer = known.outer_size or (args.num_distributed_optimizer_instances if args.dp_outer_size > 1 else 2)
    if args.pipeline_model_parallel_size > 1:
        return _main_per_stage(args, known.world_size, outer)
    units, plans = estimate(args, known.world_size, outer)
    n = sum(u.numel for u in units)
    tp, ep = args.tensor_model_parallel_size, (args.expert_model_parallel_size if args.num_experts else 1)
    cp = args.context_parallel_size
    cp_text = f" x CP {cp} ({' '.join(args.cp_comm_type)})" if cp > 1 else ""
    print(f"model: {n:,} parameters per TP/EP rank in {len(units)} units; world size {known.world_size} = "
          f"TP {tp} x DP {known.world_size // tp // cp}{cp_text}{f' (EP {ep})' if args.num_experts else ''}; "
          f"{args.num_microbatches} microbatch(es) of {args.micro_batch_size} x {args.seq_length} per rank per step"
          + (f" ({args.seq_length // cp} tokens of each sequence per CP rank)" if cp > 1 else "")
          + f"; HSDP/HFSDP with {outer} replicas")
    print("MiB per rank; act = saved activations of one microbatch, _rc = with full recompute")
    if args.num_experts:
        print("act: MoE layers as k rows of --moe-ffn-hidden-size per token under uniform routing (an estimate)")
    if args.num_experts and ep > 1:
        if args.moe_expert_capacity_factor is not None:
            print("all_to_all: planned as dropless; with --moe-expert-capacity-factor it differs (dropping "
                  "sends fewer rows, padding to capacity sends capacity rows per expert)")
        else:
            print("all_to_all: dropless routing, the value for uniform routing (what a rank receives varies)")
    print(format_plans(plans))
    return plans


def _main_per_stage(args, world_size: int, outer: int):
    """One table per pipeline stage; returns {stage: plans}."""
    from tools.memory_planner.estimate import format_plans
    from megatron.training.pipeline_arguments import pipeline_layout_from_args

    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    vp = args.virtual_pipeline_model_parallel_size or 1
    layout = pipeline_layout_from_args(args)
    cp = args.context_parallel_size
    print(f"world size {world_size} = PP {pp} x TP {tp} x DP {world_size // (pp * tp * cp)}"
          f"{f' x CP {cp}' if cp > 1 else ''}; "
          f"{'1F1B' if vp == 1 else f'interleaved, {vp} virtual stages'}; {args.num_microbatches} microbatch(es) of "
          f"{args.micro_batch_size} x {args.seq_length} per pipeline per step; HSDP/HFSDP with {outer} replicas")
    print("MiB per rank; act = the saved activations of the microbatches the stage holds at once, "
          "_rc = with full recompute")
    out = {}
    for stage in range(pp):
        units, plans = estimate(args, world_size, outer, stage)
        layers = ", ".join(f"{c[0]}-{c[-1]}" if c else "none" for c in (layout.layers_of(stage, v) for v in range(vp)))
        print(f"\nstage {stage}: layers {layers}; {sum(u.numel for u in units):,} parameters per TP rank in "
              f"{len(units)} units; {activations_in_flight(args, stage)} microbatch(es) of one chunk in flight")
        print(format_plans(plans))
        out[stage] = plans
    return out


if __name__ == "__main__":
    main()
