#!/usr/bin/env python
"""The largest GPT each contender trains on this box: MFSDP ZeRO-3, PyTorch FSDP2, DDP.

    python benchmarks/largest_model.py --nproc 4 --memory-budget-gib 20 --out benchmarks/results/largest_model.json
    python benchmarks/largest_model.py --nproc 2 --memory-budget-gib 2 --hidden 256 --out /tmp/largest.json  # smoke

For N CPU ranks (gloo, fp32 AdamW), the driver searches the number of layers of a GPT
(fixed width: ``--hidden``, heads of 128, FFN 4x, ``--vocab``, full activation recompute,
1 sequence of ``--seq-length`` per rank) that trains 2 iterations without exceeding the
memory budget: doubling until a trial fails, then bisecting. Each trial is one
``torch.distributed.run`` launch in its own process group, built the contender's own way:

* ``mfsdp_zero3``: parameters on ``meta`` (the trainer's ``parameters_on_meta``), every
  layer and then the root wrapped, materialized unit by unit into shards
  (``FsdpModule.init_parameters``) with the trainer's seeded init;
* ``fsdp2``: built under ``torch.device("meta")``, ``fully_shard`` per layer and root,
  ``to_empty`` and ``reset_parameters`` on the sharded DTensors (FSDP2's documented path);
* ``ddp``: built whole on every rank, then ``DistributedDataParallel``.

The guard: a sampler reads the summed RSS of the trial's processes and the box's
MemAvailable every 50 ms and kills the trial's process group when the sum passes the
budget or MemAvailable falls below ``--reserve-gib``, before the box runs out. A killed
trial counts as "does not fit".

Reported per contender: parameters trained, summed peak RSS (per-rank VmHWM, summed),
time per iteration (the second), and the fraction of the physical bound:
parameters x 16 bytes (fp32 weight, gradient, two Adam states) / the memory budget.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

_REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

CONTENDERS = ("mfsdp_zero3", "fsdp2", "ddp")
BYTES_PER_PARAM = 16  # fp32 Adam: weight, gradient, exp_avg, exp_avg_sq
GIB = 2**30


# --- worker (one rank of one trial) -------------------------------------------------------

def _config(args):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=args.layers, hidden_size=args.hidden,
                             num_attention_heads=max(1, args.hidden // 128), recompute_granularity="full")


def _provider(args):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(_config(args), vocab_size=args.vocab, max_sequence_length=args.seq_length)


def _build(args, mesh):
    import torch

    if args.contender == "mfsdp_zero3":
        from megatron.core.distributed.mfsdp_v2 import Placements, fully_shard, fully_shard_context
        from megatron.training.model_builder import materialize_units, parameters_on_meta

        with parameters_on_meta():
            model = _provider(args)
        with fully_shard_context(device=torch.device("cpu")):
            units = [fully_shard(layer, mesh, Placements.zero3("dp")) for layer in model.decoder.layers]
            units.append(fully_shard(model, mesh, Placements.zero3("dp")))
        materialize_units(units, args.seed)
        return model, model
    if args.contender == "fsdp2":
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

        with torch.device("meta"):
            model = _provider(args)
        for layer in model.decoder.layers:
            fsdp2_fully_shard(layer, mesh=mesh)
        fsdp2_fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        torch.manual_seed(args.seed)
        model.reset_parameters()
        return model, model
    from megatron.core.transformer.initialization import initialize_parameters_

    model = _provider(args)
    initialize_parameters_(model, args.seed)
    return torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True), model


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    start = time.perf_counter()
    model, unwrapped = _build(args, mesh)
    build_s = time.perf_counter() - start
    params = sum(p.numel() for p in unwrapped.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(args.seed + rank)
    times, losses = [], []
    for _ in range(2):
        tokens = torch.randint(0, args.vocab, (1, args.seq_length + 1), generator=generator)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    peaks = [None] * world
    dist.all_gather_object(peaks, _status_bytes("VmHWM"))
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"params": params, "peak_rss_per_rank": peaks, "build_s": build_s,
                       "iteration_s": times, "losses": losses}, f)
    dist.barrier()
    dist.destroy_process_group()


# --- driver ------------------------------------------------------------------------------

def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_trial(opts, contender: str, layers: int) -> dict:
    """Launch one trial under the guard; {"fits": bool, ...measurements}."""
    with tempfile.TemporaryDirectory(prefix="largest_") as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(opts.nproc),
               os.path.abspath(__file__), "--worker", "--contender", contender, "--layers", str(layers),
               "--hidden", str(opts.hidden), "--vocab", str(opts.vocab), "--seq-length", str(opts.seq_length),
               "--seed", str(opts.seed), "--result", result]
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        env["PYTHONPATH"] = _REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        budget, reserve = int(opts.memory_budget_gib * GIB), int(opts.reserve_gib * GIB)
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)  # own process group: the guard kills it whole
        killed, sampled_peak = None, 0
        while proc.poll() is None:
            rss, available = tree_rss(proc.pid), mem_available()
            sampled_peak = max(sampled_peak, rss)
            if rss > budget:
                killed = f"summed RSS {rss / GIB:.2f} GiB > budget {opts.memory_budget_gib} GiB"
            elif available < reserve:
                killed = f"MemAvailable {available / GIB:.2f} GiB < reserve {opts.reserve_gib} GiB"
            elif time.perf_counter() - start > opts.trial_timeout:
                killed = f"trial ran past {opts.trial_timeout} s"
            if killed:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.05)
        output = proc.stdout.read().decode(errors="replace")
        trial = {"contender": contender, "layers": layers, "sampled_peak_rss": sampled_peak,
                 "wall_s": time.perf_counter() - start}
        if killed or proc.returncode != 0 or not os.path.exists(result):
            trial.update(fits=False, reason=killed or f"exit code {proc.returncode}: {output[-400:]}")
            return trial
        with open(result) as f:
            trial.update(json.load(f))
        trial["summed_peak_rss"] = sum(trial["peak_rss_per_rank"])
        trial["fits"] = trial["summed_peak_rss"] <= budget
        if not trial["fits"]:
            trial["reason"] = f"summed VmHWM {trial['summed_peak_rss'] / GIB:.2f} GiB > budget"
        return trial


def largest(opts, contender: str, log) -> dict:
    """The best trial that fit, searching the number of layers from the contender's start:
    steps of 1, 2, 4, ... away from it (up while trials fit, down while they do not) until
    the answer is bracketed, then bisection. A good start (the planner's estimate) settles it
    in two trials; a start of 1 is plain doubling."""
    best, trials = None, []

    def attempt(layers):
        trial = run_trial(opts, contender, layers)
        trials.append(trial)
        state = "fits" if trial["fits"] else f"does not fit ({trial['reason'].splitlines()[0][:120]})"
        log(f"  {contender:12s} layers {layers:4d}: {state}"
            + (f", {trial['params'] / 1e6:.1f}M params, summed peak {trial['summed_peak_rss'] / GIB:.2f} GiB"
               if trial["fits"] else ""))
        return trial

    low, high = 0, opts.max_layers + 1  # low fits (0: none known), high does not
    start = opts.start_layers[contender]
    trial = attempt(start)
    going_up = trial["fits"]
    if going_up:
        best, low = trial, start
    else:
        high = start
    step = 1
    while True:  # gallop away from the start until a trial brackets the answer
        layers = low + step if going_up else high - step
        if not low < layers < high:
            break
        trial = attempt(layers)
        if trial["fits"]:
            best, low = trial, layers
        else:
            high = layers
        if trial["fits"] != going_up:
            break
        step *= 2
    while high - low > 1:
        mid = (low + high) // 2
        trial = attempt(mid)
        if trial["fits"]:
            best, low = trial, mid
        else:
            high = mid
    return {"contender": contender, "best": best, "trials": trials}


def parse_start_layers(text: str, contenders) -> dict:
    """``N`` for every contender, or ``contender=N,...`` (the others start at 1)."""
    if "=" not in text:
        return {c: int(text) for c in contenders}
    out = {c: 1 for c in contenders}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in contenders:
            raise ValueError(f"--start-layers names {name!r}, which is not among the contenders {list(contenders)}")
        out[name] = int(value)
    return out


def summarize(opts, results) -> str:
    budget = opts.memory_budget_gib * GIB
    lines = [f"Largest GPT that trains 2 iterations: {opts.nproc} CPU ranks, budget {opts.memory_budget_gib} GiB "
             f"(physical bound {budget / BYTES_PER_PARAM / 1e6:.0f}M params at {BYTES_PER_PARAM} B/param), "
             f"hidden {opts.hidden}, vocab {opts.vocab}, seq {opts.seq_length}, full recompute",
             "",
             "| contender | layers | params | summed peak RSS (GiB) | time/iteration (s) | fraction of bound | vs DDP |",
             "|---|---|---|---|---|---|---|"]
    ddp = next((r["best"]["params"] for r in results if r["contender"] == "ddp" and r["best"]), None)
    for r in results:
        b = r["best"]
        if b is None:
            lines.append(f"| {r['contender']} | - | nothing fits | - | - | - | - |")
            continue
        fraction = b["params"] * BYTES_PER_PARAM / budget
        vs = f"{b['params'] / ddp:.2f}x" if ddp else "-"
        lines.append(f"| {r['contender']} | {b['layers']} | {b['params'] / 1e6:.1f}M | "
                     f"{b['summed_peak_rss'] / GIB:.2f} | {b['iteration_s'][-1]:.2f} | {fraction:.2f} | {vs} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--memory-budget-gib", type=float, default=None,
                   help="summed RSS of all ranks a trial may use (the box's memory for training)")
    p.add_argument("--reserve-gib", type=float, default=1.0, help="kill a trial when MemAvailable falls below this")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--max-layers", type=int, default=256)
    p.add_argument("--start-layers", default="1",
                   help="first trial's layers, N or contender=N,... (e.g. tools/estimate_memory.py's estimate): "
                        "saves hours of trials far from the answer")
    p.add_argument("--trial-timeout", type=float, default=1800)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="JSON with every trial; the table goes next to it as .md")
    # Worker-only flags (set by the driver).
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.worker:
        return worker(opts)
    if opts.memory_budget_gib is None:
        p.error("--memory-budget-gib is required: the summed memory all ranks of a trial may use")
    contenders = opts.contenders.split(",")
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown:
        p.error(f"unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")
    try:
        opts.start_layers = parse_start_layers(opts.start_layers, contenders)
    except ValueError as e:
        p.error(str(e))
    if not all(1 <= n <= opts.max_layers for n in opts.start_layers.values()):
        p.error(f"--start-layers must be between 1 and --max-layers ({opts.max_layers})")
    if opts.hidden % 128 and opts.hidden > 128:
        p.error("--hidden must be a multiple of 128 (heads of 128), or at most 128")
    if opts.memory_budget_gib * GIB > mem_available() - opts.reserve_gib * GIB:
        p.error(f"--memory-budget-gib {opts.memory_budget_gib} exceeds what this box has available "
                f"({mem_available() / GIB:.1f} GiB minus the {opts.reserve_gib} GiB reserve); lower it.")
    results = []
    for contender in contenders:
        print(f"searching {contender} ...", flush=True)
        results.append(largest(opts, contender, lambda m: print(m, flush=True)))
    table = summarize(opts, results)
    print(table)
    if opts.out:
        os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
        with open(opts.out, "w") as f:
            json.dump({"options": {k: v for k, v in vars(opts).items() if k not in ("worker", "contender", "layers",
                                                                                      "result")},
                       "results": results}, f, indent=1)
        with open(os.path.splitext(opts.out)[0] + ".md", "w") as f:
            f.write(table + "\n")
    return results


if __name__ == "__main__":
    main()
