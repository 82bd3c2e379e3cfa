"""Time context-parallel attention (forward + backward) per communication type.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \
        benchmarks/context_parallel_attention.py --seq 2048

cp = the world size; every rank holds 2 * seq / (2 * cp) tokens of q [b, H, s, d] and
k, v [b, G, s, d]. Prints rank 0's median over ``--reps`` steps (after one warm-up), the
slowest rank's time per step being what a step costs. "a2a+p2p" runs as 2 x (cp / 2)
(a2a groups of 2 consecutive ranks) where cp >= 4. Not part of the test suite.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from megatron.core.transformer.context_parallel import (
    SUPPORTED_CP_COMM_TYPES,
    context_parallel_attention,
    split_for_context_parallel,
)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full = [torch.randn(args.batch, n, args.seq, args.head_dim) for n in (args.heads, args.groups, args.groups)]
    local = [split_for_context_parallel(t, cp, rank, seq_dim=2) for t in full]
    hierarchical = None
    if cp >= 4 and cp % 2 == 0:
        a2a_groups = [dist.new_group([2 * o, 2 * o + 1]) for o in range(cp // 2)]
        p2p_groups = [dist.new_group(list(range(i, cp, 2))) for i in range(2)]
        hierarchical = (a2a_groups[rank // 2], p2p_groups[rank % 2])
    for comm_type in SUPPORTED_CP_COMM_TYPES:
        if comm_type == "a2a+p2p" and (hierarchical is None or args.groups % 2):
            continue
        if comm_type == "a2a" and (args.heads % cp or args.groups % cp):
            continue  # Ulysses scatters whole heads and query groups
        times = []
        for _ in range(args.reps + 1):
            leaves = [t.clone().requires_grad_() for t in local]
            dist.barrier()
            start = time.perf_counter()
            context_parallel_attention(*leaves, dist.group.WORLD, comm_type,
                                       hierarchical_groups=hierarchical).sum().backward()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step waits for the slowest rank
            times.append(elapsed.item())
        if rank == 0:
            print(f"cp={cp} {comm_type:>10}: {1e3 * statistics.median(times[1:]):8.1f} ms fwd+bwd "
                  f"(seq {args.seq}, b {args.batch}, heads {args.heads}/{args.groups}, d {args.head_dim})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
