"""The benchmark's modes (compare_dp.py ``--mode``): compare (every contender interleaved
on the same batches, plus bytes, hook time and a Python profile), sweep (a grid of model
sizes) and overlap (prefetch variants against compute-only and communication-only times).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
from typing import List

import torch
import torch.distributed as dist

from contenders import (Contender, Meshes, ModelSpec, Options, base_name, build, build_fsdp2, build_mfsdp,
                        build_plain, build_reference, default_contenders, dtype_name, make_batches, resolve_spec)
from measurement import (count_collectives, engine_cpu_time, expected_bytes, gather_floats, hook_overhead, log,
                         padding_bound, profile_python_self_time, rank, summarize, timing_summary, world)


def run_interleaved(contenders: List[Contender], batches, warmup: int, steps: int, memory_step: int) -> None:
    """Rounds of A B C ...; every contender runs the round's batch; a barrier before every
    step so each contender starts with all ranks together."""
    for r in range(warmup + steps):
        inputs, labels = batches[r]
        for c in contenders:
            dist.barrier()
            result = c.step(inputs, labels, measure_memory=(r == memory_step))
            c.losses.append(result["loss"])
            if r >= warmup:
                c.times.append(result)
        if rank() == 0 and (r < 2 or r == warmup + steps - 1 or r % 5 == 0):
            line = " ".join(f"{c.name}={c.times[-1]['step'] if c.times else float('nan'):.3f}s" for c in contenders)
            log(f"round {r + 1}/{warmup + steps} {line}")


def global_losses(c: Contender) -> List[float]:
    """The global loss per step: every rank's local mean, averaged (computed after timing)."""
    per_rank = gather_floats(c.losses)
    return [sum(col) / len(col) for col in zip(*per_rank)]


def mode_compare(args, spec: ModelSpec, dtype: torch.dtype, meshes: Meshes, opts: Options) -> dict:
    names = args.contenders or default_contenders(world())
    n = world()
    ref = build_reference(spec, args.seed, dtype)
    contenders = [build(name, ref, dtype, meshes, opts) for name in names]
    gc.collect()
    rounds = args.warmup + args.steps
    batches = make_batches(spec, rounds + 2, args.seed + 1)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    run_interleaved(contenders, batches, args.warmup, args.steps, memory_step=min(1, rounds - 1))
    elapsed = time.perf_counter() - t_start
    load_after = os.getloadavg()
    global_tokens = n * spec.micro_batch * spec.seq
    results = {}
    for c in contenders:
        results[c.name] = {
            "timing": timing_summary(c, global_tokens, spec),
            "losses": global_losses(c),
            "persistent_bytes": c.persistent,
            "padding": padding_bound(c),
            "expected": expected_bytes(spec, dtype, base_name(c.name), n),
        }
    # Untimed extras: one counted step each, then MFSDP hook timing and cProfile.
    for c in contenders:
        dist.barrier()
        results[c.name]["collectives"] = count_collectives(c, batches[rounds])
    if "mfsdp_no_shard" not in names and not args.no_count_no_shard:
        # Bytes only (the no_shard = 2x target): one counted step, then dropped.
        probe = build_mfsdp("mfsdp_no_shard", ref, dtype, lambda P: P.no_shard(), meshes.flat, opts, 1)
        dist.barrier()
        results["mfsdp_no_shard"] = {
            "collectives": count_collectives(probe, batches[rounds]),
            "expected": expected_bytes(spec, dtype, "mfsdp_no_shard", n),
            "bytes_only": True,
        }
        del probe
    hook_steps = max(1, min(3, args.steps))
    for c in contenders:
        dist.barrier()
        if c.kind == "mfsdp":
            results[c.name]["hooks"] = hook_overhead(c, batches[rounds + 1], hook_steps)
            dist.barrier()
            results[c.name]["engine_cpu"] = engine_cpu_time(c, batches[rounds + 1], hook_steps)
        if c.kind in ("mfsdp", "fsdp2") and not args.no_profile:
            dist.barrier()
            prof = profile_python_self_time(c, batches[rounds + 1])
            units = len(c.ctx.units) if c.kind == "mfsdp" else spec.layers + 1
            prof["units"] = units
            prof["engine_python_self_s_per_unit"] = prof["engine_python_self_s"] / units
            results[c.name]["python_profile"] = prof
    del contenders, ref
    gc.collect()
    return {
        "mode": "compare", "dtype": dtype_name(dtype), "world_size": n, "model": dataclasses.asdict(spec),
        "model_description": spec.describe(), "num_params": spec.num_params(), "contenders": names,
        "warmup": args.warmup, "steps": args.steps, "global_tokens_per_step": global_tokens,
        "elapsed_s": elapsed, "loadavg_before": load_before, "loadavg_after": load_after, "results": results,
    }


def mode_sweep(args, dtype: torch.dtype, meshes: Meshes, opts: Options) -> dict:
    names = args.contenders or ["mfsdp_zero3", "fsdp2", "ddp"]
    base = resolve_spec(args, dtype_name(dtype))
    points = []
    for hidden in args.sweep_hidden:
        for layers in args.sweep_layers:
            spec = dataclasses.replace(base, layers=layers, hidden=hidden, heads=max(1, hidden // 64))
            ref = build_reference(spec, args.seed, dtype)
            contenders = [build(name, ref, dtype, meshes, opts) for name in names]
            batches = make_batches(spec, args.warmup + args.steps, args.seed + 1)
            run_interleaved(contenders, batches, args.warmup, args.steps,
                            memory_step=min(1, args.warmup + args.steps - 1))
            tokens = world() * spec.micro_batch * spec.seq
            entry = {"layers": layers, "hidden": hidden, "num_params": spec.num_params(), "results": {}}
            for c in contenders:
                t = timing_summary(c, tokens, spec)
                entry["results"][c.name] = {"step": t["step"], "persistent_bytes": c.persistent}
            points.append(entry)
            log(f"sweep L={layers} h={hidden}: " + " ".join(
                f"{k}={v['step']['median']:.3f}s/{v['persistent_bytes']['total'] / 2**20:.1f}MiB"
                for k, v in entry["results"].items()))
            del contenders, ref
            gc.collect()
    return {"mode": "sweep", "dtype": dtype_name(dtype), "world_size": world(), "points": points,
            "base_model": dataclasses.asdict(base), "warmup": args.warmup, "steps": args.steps,
            "contenders": names, "loadavg": os.getloadavg()}


def comm_only_time(contender: Contender, repeats: int) -> dict:
    """The collectives of one ZeRO-3 step issued back to back with no compute, with the
    sizes, dtypes and groups of the engine's: forward all-gathers in forward order, then per
    unit in backward order an all-gather (not for the root, which stays unsharded) and a
    reduce-scatter. Each is waited for before the next: nothing overlaps."""
    groups = []
    for unit in contender.ctx.forward_order:
        for g in unit.parameter_groups:
            groups.append((g, unit.is_root()))
    buffers = []
    for g, is_root in groups:
        shard = torch.zeros(g.layout.shard_numel, dtype=g.dtype)
        gathered = torch.zeros(g.layout.gathered_numel, dtype=g.dtype)
        grad_full = torch.zeros(g.layout.gathered_numel, dtype=g.precision.grad_comm)
        grad_shard = torch.zeros(g.layout.shard_numel, dtype=g.precision.grad_comm)
        buffers.append((g.inner_group, is_root, shard, gathered, grad_full, grad_shard))
    times, cpu = [], []
    for _ in range(repeats):
        dist.barrier()
        c = time.process_time()  # CPU time of every thread of this rank (gloo's included), user + system
        t = time.perf_counter()
        for group, _, shard, gathered, _, _ in buffers:
            dist.all_gather_single(gathered, shard, group=group)
        for group, is_root, shard, gathered, grad_full, grad_shard in reversed(buffers):
            if not is_root:
                dist.all_gather_single(gathered, shard, group=group)
            dist.reduce_scatter_single(grad_shard, grad_full, group=group)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    slowest = [max(col) for col in zip(*gather_floats(times))]
    out = summarize(slowest)
    # CPU seconds a rank burns to move one step's bytes: on a machine with no idle core,
    # this is time taken from compute, whatever the overlap.
    out["cpu_s_per_rank"] = statistics.median(max(col) for col in zip(*gather_floats(cpu)))
    return out


def mode_overlap(args, spec: ModelSpec, dtype: torch.dtype, meshes: Meshes, opts: Options) -> dict:
    ref = build_reference(spec, args.seed, dtype)
    variants = []
    for name, depth in (("mfsdp_zero3_prefetch1", 1), ("mfsdp_zero3_noprefetch", 0), ("mfsdp_zero3_prefetch2", 2)):
        variants.append(build_mfsdp(name, ref, dtype, lambda P: P.zero3(), meshes.flat,
                                    dataclasses.replace(opts, mfsdp_prefetch=depth), world()))
    for name, fwd in (("fsdp2", False), ("fsdp2_fwd_prefetch", True)):
        variants.append(build_fsdp2(name, ref, dtype, meshes.flat, dataclasses.replace(opts, fsdp2_forward_prefetch=fwd)))
    variants.append(build_plain(ref, dtype, opts))
    batches = make_batches(spec, args.warmup + args.steps, args.seed + 1)
    run_interleaved(variants, batches, args.warmup, args.steps, memory_step=-1)
    tokens = world() * spec.micro_batch * spec.seq
    out = {}
    for c in variants:
        t = timing_summary(c, tokens, spec)
        out[c.name] = {k: t[k] for k in ("step", "forward", "backward", "optimizer")}
    comm = comm_only_time(variants[0], max(3, args.steps // 2))
    compute = out["plain"]["forward"]["median"] + out["plain"]["backward"]["median"]
    # fp32 ZeRO-3's optimizer step is local (main weight = compute weight): no communication.
    opt = out["mfsdp_zero3_prefetch1"]["optimizer"]["median"]
    return {"mode": "overlap", "dtype": dtype_name(dtype), "world_size": world(),
            "model": dataclasses.asdict(spec), "model_description": spec.describe(), "variants": out,
            "comm_only": comm, "compute_only_fwd_bwd_s": compute, "mfsdp_optimizer_s": opt,
            "serial_bound_s": compute + comm["median"] + opt,
            "overlap_bound_s": max(compute, comm["median"]) + opt,
            "loadavg": os.getloadavg(), "warmup": args.warmup, "steps": args.steps}
