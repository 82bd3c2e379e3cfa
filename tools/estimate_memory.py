#!/usr/bin/env python
"""Per-rank memory and communication of every data-parallel strategy, before training.

    python tools/estimate_memory.py --world-size 4 --num-layers 24 --hidden-size 2048 \
        --num-attention-heads 16 --seq-length 1024 --micro-batch-size 1 --global-batch-size 8 \
        --tokenizer-type NullTokenizer --vocab-size 50257 --lr 1e-4 --train-iters 1

Takes pretrain_gpt.py's own flags (parsed and validated by the trainer's parser) and the
world size; builds the model on the meta device (no memory) and prints, per strategy
(DDP, ZeRO-1/2/3, HSDP, HFSDP) and per rank, the persistent bytes, the transient peak
and the bytes sent per step by collective kind (megatron/core/distributed/mfsdp_v2/estimate.py).
"""

import argparse
import os
import sys

_REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import torch  # noqa: E402

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def model_units(args):
    """(units of the model the trainer would build, ActivationShape), without memory."""
    from megatron.core.distributed.mfsdp_v2.estimate import ActivationShape, units_of
    from megatron.training.training import build_tokenizer_from_args
    from pretrain_gpt import model_provider

    build_tokenizer_from_args(args)
    with torch.device("meta"):
        model = model_provider(args)
    units = units_of(model, list(model.decoder.layers) + [model])
    shape = ActivationShape(args.micro_batch_size, args.seq_length, args.hidden_size, args.num_attention_heads,
                            args.ffn_hidden_size, args.num_layers, args.padded_vocab_size,
                            element_bytes=2 if args.bf16 else 4)
    return units, shape


def estimate(args, world_size: int, outer_size: int):
    """Plans of every strategy that fits ``world_size`` (hybrids need outer_size | world)."""
    from megatron.core.distributed.mfsdp_v2.estimate import STRATEGIES, plan

    units, shape = model_units(args)
    compute = 2 if args.bf16 else 4
    grads = _BYTES[args.main_grads_dtype] if args.main_grads_dtype is not None else compute
    comm = _BYTES[args.grad_comm_dtype] if args.grad_comm_dtype is not None else grads
    plans = []
    for strategy in STRATEGIES:
        hybrid = strategy in ("hsdp", "hfsdp")
        if hybrid and (outer_size < 2 or world_size % outer_size):
            continue
        # HFSDP's outer shards differ between ranks: report the largest.
        ranks = range(world_size) if strategy == "hfsdp" else [0]
        candidates = [
            plan(units, strategy, world_size, outer_size=outer_size if hybrid else 1,
                 microbatches=args.num_microbatches, compute_bytes=compute, grad_bytes=grads, comm_bytes=comm,
                 rank=r, activations=shape)
            for r in ranks
        ]
        plans.append(max(candidates, key=lambda p: p.persistent_total))
    return units, plans


def main(argv=None):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--world-size", type=int, required=True, help="number of data-parallel ranks")
    pre.add_argument("--outer-size", type=int, default=None,
                     help="replicas for HSDP/HFSDP (default --num-distributed-optimizer-instances, else 2)")
    known, rest = pre.parse_known_args(argv)
    if known.world_size < 1:
        raise SystemExit("estimate_memory.py: error: --world-size must be at least 1.")
    from megatron.core.distributed.mfsdp_v2.estimate import format_plans
    from megatron.training.arguments import parse_args

    try:
        args = parse_args(rest, world_size=known.world_size, cuda_available=False)
    except ValueError as error:
        raise SystemExit(f"estimate_memory.py: error: {error}")
    if args.tensor_model_parallel_size > 1:
        raise SystemExit("estimate_memory.py: error: the planner covers data parallelism only; drop "
                         "--tensor-model-parallel-size (docs/design.md gives TP x FSDP's per-rank memory).")
    if args.num_experts:
        # Expert units live on their own sub-mesh with their own divisor; the planner has one mesh.
        raise SystemExit("estimate_memory.py: error: the planner does not model mixture-of-experts models yet "
                         "(expert units are sharded over the expert-data-parallel mesh); drop --num-experts.")
    outer = known.outer_size or (args.num_distributed_optimizer_instances if args.dp_outer_size > 1 else 2)
    units, plans = estimate(args, known.world_size, outer)
    n = sum(u.numel for u in units)
    print(f"model: {n:,} parameters in {len(units)} units; world size {known.world_size}; "
          f"{args.num_microbatches} microbatch(es) of {args.micro_batch_size} x {args.seq_length} per rank per step; "
          f"HSDP/HFSDP with {outer} replicas")
    print("MiB per rank; act = saved activations of one microbatch, _rc = with full recompute")
    print(format_plans(plans))
    return plans


if __name__ == "__main__":
    main()
