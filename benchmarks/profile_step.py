#!/usr/bin/env python
"""Profile a few training steps of one or more contenders with torch.profiler (CPU).

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/profile_step.py \
        --contenders mfsdp_zero3,fsdp2 --out benchmarks/results/profile

Per contender: the operator table (self CPU time, calls) of rank 0, the time per
phase (forward, backward, optimizer), and a Chrome trace (``<out>/<name>_rank0.json``;
open it in chrome://tracing or Perfetto). Contenders are built from one reference init,
as in compare_dp.py, and profiled one after the other after ``--warmup`` interleaved rounds.
``--prototype NAME`` applies a benchmark-only engine prototype (see prototypes.py) to the
MFSDP contenders, so its effect can be profiled before anyone changes the engine.
``--breakdown`` reads the trace back and charges every operator's self time on the
training thread to the innermost engine range around it (``MFSDP launch all_gather``,
``MFSDP post_ops reduce_scatter``, ``MFSDP stash_grad``, a hook, ...; "outside" when none):
milliseconds per step per range, with the operators that make them up.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import contenders as cd  # noqa: E402
from modes import run_interleaved  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--contenders", default="mfsdp_zero3,fsdp2")
    p.add_argument("--dtype", default="fp32", choices=tuple(cd.DTYPES))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--no-trace", action="store_true")
    p.add_argument("--shapes", action="store_true", help="group the operator table by input shape")
    p.add_argument("--breakdown", action="store_true", help="engine time per range and operator (needs the trace)")
    p.add_argument("--prototype", default="", help="comma-separated prototypes.py variants for the MFSDP contenders")
    for key in ("layers", "hidden", "heads", "vocab", "seq", "micro_batch"):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.breakdown and args.no_trace:
        p.error("--breakdown reads the Chrome trace: drop --no-trace")
    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    dtype = cd.DTYPES[args.dtype]
    spec = cd.resolve_spec(args, args.dtype)
    meshes = cd.Meshes()
    opts = cd.Options()
    ref = cd.build_reference(spec, args.seed, dtype)
    # --prototype X,Y profiles MFSDP contender "name+X+Y" (prototypes.py) instead of "name".
    suffix = "".join("+" + name for name in args.prototype.split(",") if name)
    names = [n + suffix if n.startswith("mfsdp") else n for n in args.contenders.split(",")]
    contenders = [cd.build(n, ref, dtype, meshes, opts) for n in names]
    batches = cd.make_batches(spec, args.warmup + args.steps, args.seed + 1)
    run_interleaved(contenders, batches, args.warmup, 0, memory_step=-1)
    os.makedirs(args.out, exist_ok=True)
    summary = {}
    for c in contenders:
        dist.barrier()
        phases = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
            for i in range(args.steps):
                r = c.step(*batches[args.warmup + i])
                phases.append(r)
        if dist.get_rank() == 0:
            table = prof.key_averages(group_by_input_shape=args.shapes).table(sort_by="self_cpu_time_total", row_limit=args.rows)
            print(f"\n===== {c.name} ({args.dtype}, N={dist.get_world_size()}, {args.steps} profiled steps) =====")
            print("phases (s): " + ", ".join(
                f"step {r['step']:.3f} fwd {r['forward']:.3f} bwd {r['backward']:.3f} opt {r['optimizer']:.3f}"
                for r in phases))
            print(table)
            ops = {e.key: {"self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
                   for e in prof.key_averages()}
            summary[c.name] = {"phases": phases, "ops": ops}
            if not args.no_trace:
                trace = os.path.join(args.out, f"{c.name}_{args.dtype}_n{dist.get_world_size()}_rank0.json")
                prof.export_chrome_trace(trace)
                if args.breakdown:
                    summary[c.name]["breakdown"] = breakdown = engine_breakdown(trace, args.steps)
                    print(format_breakdown(breakdown))
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, f"profile_{args.dtype}_n{dist.get_world_size()}.json"), "w") as f:
            json.dump({"model": spec.describe(), "prototype": args.prototype, "loadavg": os.getloadavg(),
                       "contenders": summary}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def _range_key(name: str) -> str:
    """``MFSDP <unit> <hook>`` -> the hook; ``MFSDP launch all_gather`` -> itself."""
    words = name.split()
    if words[1] in ("launch", "wait", "post_ops"):
        return " ".join(words[:3])
    if words[1] in ("stash_grad", "finish_backward"):
        return name
    return "MFSDP " + words[-1]  # a hook body outside its nested ranges


def engine_breakdown(trace_path: str, steps: int) -> dict:
    """{range: {"ms_per_step": total, "ops": {operator: ms per step}}} of the thread that
    ran the engine's ranges. gloo's ``gloo:*`` events span a collective's lifetime, not
    work on this thread, and do not nest: they are left out."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"]
                  if e.get("ph") == "X" and not e["name"].startswith("gloo:")
                  and e.get("cat") in ("cpu_op", "user_annotation")]
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[e["tid"]].append(e)
    thread = max(by_thread, key=lambda t: sum(e["dur"] for e in by_thread[t] if e["name"].startswith("MFSDP")))
    stack, child_time, owner = [], collections.defaultdict(float), {}
    for e in sorted(by_thread[thread], key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            child_time[id(stack[-1])] += e["dur"]
        ranges = [s["name"] for s in stack + [e] if s["name"].startswith("MFSDP")]
        owner[id(e)] = (e, _range_key(ranges[-1]) if ranges else "outside")
        stack.append(e)
    table = collections.defaultdict(lambda: collections.defaultdict(float))
    for key, (e, where) in owner.items():
        table[where][e["name"]] += (e["dur"] - child_time[key]) / 1e3 / steps
    return {where: {"ms_per_step": sum(ops.values()), "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}
            for where, ops in sorted(table.items(), key=lambda kv: -sum(kv[1].values()))}


def format_breakdown(breakdown: dict, top: int = 5) -> str:
    lines = ["engine time per step by range (self time of the operators inside; ms):"]
    for where, entry in breakdown.items():
        ops = ", ".join(f"{name} {ms:.1f}" for name, ms in list(entry["ops"].items())[:top])
        lines.append(f"  {where:36s} {entry['ms_per_step']:8.1f}   {ops}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
