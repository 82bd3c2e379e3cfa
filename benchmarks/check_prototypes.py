#!/usr/bin/env python
"""Correctness check of the prototypes in prototypes.py: the patched engine must train
exactly like the stock engine. With ``--engine-rev REV`` the engine at git revision REV
(engine_snapshot.py) is checked against the working tree's the same way, so an engine
change that must not change numerics is proven to train bit for bit like its predecessor.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/check_prototypes.py
    python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/check_prototypes.py --engine-rev HEAD
    ... --engine-rev main --no-prototypes    # only the engine at main against the tree's

For ZeRO-3, ZeRO-2 (and HSDP at 4 ranks; with ``--no-prototypes`` also ZeRO-1, no_shard
and HFSDP), fp32 and bf16-with-fp32-main, 1 and 3
microbatches, ``zero_grad(set_to_none=True)`` and ``False``: a stock and a patched copy of
one GPT train 3 steps on the same data; losses, local weights and local gradients must
agree (bitwise for power-of-two world sizes, where x/N and x*(1/N) are the same number).
"""

from __future__ import annotations

import itertools
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import contenders as cd  # noqa: E402

PROTOS = ["inflight0", "inflight2", "no_fwd_prefetch"]  # prototypes.py


def train(c, batches, micro: int, set_to_none: bool):
    losses = []
    for inputs, labels in batches:
        total = 0.0
        for i, (x, y) in enumerate(zip(inputs.chunk(micro), labels.chunk(micro))):
            with c.engine.microbatch(c.ctx, is_last=i == micro - 1):
                loss = c.model(x, labels=y).mean() / micro
                loss.backward()
            total += loss.item()
        grads = [p.grad.to_local().clone() if p.grad is not None else None for p in c.model.parameters()]
        c.optimizer.step()
        c.optimizer.zero_grad(set_to_none=set_to_none)
        losses.append(total)
    weights = [p.to_local().detach().clone() for p in c.model.parameters()]
    return losses, weights, grads


def main() -> None:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--engine-rev", default=None, help="also check the engine at this git revision against the tree's")
    p.add_argument("--no-prototypes", action="store_true", help="check only the engine at --engine-rev")
    args = p.parse_args()
    if args.no_prototypes and not args.engine_rev:
        p.error("--no-prototypes leaves nothing to check without --engine-rev")
    variants = ([] if args.no_prototypes else ["+" + "+".join(PROTOS)]) + ([f"@{args.engine_rev}"] if args.engine_rev else [])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    meshes = cd.Meshes()
    spec = cd.ModelSpec(layers=2, hidden=64, heads=2, vocab=128, seq=16, micro_batch=6)
    names = ["mfsdp_zero3", "mfsdp_zero2"] + (["mfsdp_hsdp"] if meshes.hsdp is not None else [])
    if args.no_prototypes:  # an engine revision is checked under every strategy
        names += ["mfsdp_zero1", "mfsdp_no_shard"] + (["mfsdp_hfsdp"] if meshes.hsdp is not None else [])
    exact = (dist.get_world_size() & (dist.get_world_size() - 1)) == 0
    failures = 0
    for variant, name, dtype_name, micro, set_to_none in itertools.product(
            variants, names, ("fp32", "bf16"), (1, 3), (True, False)):
        dtype = cd.DTYPES[dtype_name]
        ref = cd.build_reference(spec, 7, dtype)
        batches = cd.make_batches(spec, 3, 8)
        stock = cd.build(name, ref, dtype, meshes, cd.Options())
        patched = cd.build(name + variant, ref, dtype, meshes, cd.Options())
        a = train(stock, batches, micro, set_to_none)
        b = train(patched, batches, micro, set_to_none)
        ok = True
        for x, y in zip(a[1] + a[2], b[1] + b[2]):
            if x is None or y is None:
                ok &= x is None and y is None
            elif exact:
                ok &= torch.equal(x, y)
            else:
                ok &= torch.allclose(x, y, rtol=1e-6, atol=1e-9)
        ok &= a[0] == b[0] if exact else all(abs(u - v) <= 1e-6 * abs(u) for u, v in zip(a[0], b[0]))
        flag = torch.tensor([0 if ok else 1])
        dist.all_reduce(flag)
        # How far apart they are when they differ: the largest relative loss difference,
        # and the largest difference of any weight or gradient (max over ranks).
        spread = torch.tensor([
            max((abs(u - v) / max(abs(u), 1e-30) for u, v in zip(a[0], b[0])), default=0.0),
            max(((x - y).abs().max().item() for x, y in zip(a[1] + a[2], b[1] + b[2])
                 if x is not None and y is not None and x.numel()), default=0.0)], dtype=torch.float64)
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            detail = "" if flag.item() == 0 else f"  (loss rel. diff {spread[0]:.1e}, max tensor diff {spread[1]:.1e})"
            print(f"{'ok  ' if flag.item() == 0 else 'FAIL'} {name}{variant} {dtype_name} micro={micro} "
                  f"set_to_none={set_to_none}{detail}", flush=True)
        failures += int(flag.item() != 0)
        del stock, patched, ref
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
