#!/usr/bin/env python
"""Cost of torchft's managed replica reduction against plain HSDP, end to end through
pretrain_gpt.py, the same per-group layout on both sides:

* ``hsdp``: one job of G x R ranks, ``--use-mfsdp --num-distributed-optimizer-instances G``
  (ZeRO-3 over R ranks inside an instance, the replica all-reduce over G instances);
* ``ft``: a torchft lighthouse (in this process) and G jobs of R ranks with the ft flags
  (``--ft-min-replica-groups G``: every step has all groups), the replica all-reduce on
  torchft's managed gloo group, plus a quorum and a should_commit round per step.

Rounds are interleaved (hsdp, ft, hsdp, ft, ...); each job's step time is the median of
rank 0's "elapsed time per iteration" over the iterations after ``--warmup`` (for ft, group
0's). Writes a Markdown table (``--out``) with the load average around the run: on a shared
machine read the ratio of one round, not the absolute times.

    python benchmarks/ft_replica_cost.py                          # 2 groups x 2 ranks, 2 rounds
    python benchmarks/ft_replica_cost.py --groups 2 --ranks 1 --rounds 3 --iters 40
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse in this process: no line per quorum
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def model_args(a) -> list:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "4",
            "--seq-length", str(a.seq), "--micro-batch-size", "2",
            "--global-batch-size", str(2 * a.groups * a.ranks), "--lr", "1e-3", "--train-iters", str(a.iters),
            "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--num-workers", "0",
            "--seed", "1", "--use-mfsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT") and not k.startswith("SLURM_")}
    e.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", "RUST_LOG": "warn",
              "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    return e


def torchrun(nproc: int, args: list) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(nproc), "pretrain_gpt.py", *args], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def step_ms(output: str, warmup: int) -> float:
    times = [float(ms) for it, ms in STEP.findall(output) if int(it) > warmup]
    if not times:
        raise RuntimeError("no iteration lines in the output:\n" + output[-3000:])
    return statistics.median(times)


def run_hsdp(a) -> float:
    proc = torchrun(a.groups * a.ranks, model_args(a) + ["--num-distributed-optimizer-instances", str(a.groups)])
    out, _ = proc.communicate(timeout=a.timeout)
    if proc.returncode:
        raise RuntimeError("hsdp run failed:\n" + out[-3000:])
    return step_ms(out, a.warmup)


def run_ft(a) -> float:
    from torchft.coordination import LighthouseServer  # optional dependency (the ft extra)

    server = LighthouseServer(bind="[::]:0", min_replicas=a.groups, join_timeout_ms=10000,
                              heartbeat_timeout_ms=2000)
    try:
        procs = [torchrun(a.ranks, model_args(a) + [
            "--ft-replica-group-id", str(g), "--ft-num-replica-groups", str(a.groups),
            "--ft-min-replica-groups", str(a.groups), "--ft-lighthouse", server.address()])
            for g in range(a.groups)]
        outs = [p.communicate(timeout=a.timeout)[0] for p in procs]
    finally:
        server.shutdown()
    for p, out in zip(procs, outs):
        if p.returncode:
            raise RuntimeError("ft run failed:\n" + out[-3000:])
    return step_ms(outs[0], a.warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2, help="ranks per group (HSDP: per instance)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "ft_replica_cost.md"))
    a = p.parse_args()

    load_before, rows = os.getloadavg()[0], []
    for r in range(a.rounds):
        hsdp = run_hsdp(a)
        ft = run_ft(a)
        rows.append((r + 1, hsdp, ft))
        print(f"round {r + 1}: hsdp {hsdp:.1f} ms, ft {ft:.1f} ms, ratio {ft / hsdp:.2f}", flush=True)
    load_after = os.getloadavg()[0]
    lines = [
        f"# torchft managed replica reduction vs plain HSDP ({a.groups} groups x {a.ranks} ranks)",
        "",
        f"`python benchmarks/ft_replica_cost.py --groups {a.groups} --ranks {a.ranks} --layers {a.layers} "
        f"--hidden {a.hidden} --seq {a.seq} --iters {a.iters} --warmup {a.warmup} --rounds {a.rounds}`",
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU, gloo; 1-minute load average "
        f"{load_before:.1f} before, {load_after:.1f} after: a shared machine, read the ratios)",
        "",
        "| round | plain HSDP, ms/step | ft (torchft), ms/step | ft / HSDP |",
        "|---|---|---|---|",
    ] + [f"| {r} | {h:.1f} | {f:.1f} | {f / h:.2f} |" for r, h, f in rows]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
