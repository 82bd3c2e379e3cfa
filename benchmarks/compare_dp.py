#!/usr/bin/env python
"""MFSDP v2 vs PyTorch FSDP2 vs PyTorch DDP on one GPT model, side by side, on CPU/gloo.

Run under torch.distributed.run (one process per rank); ``run_compare.py`` launches it
for every world size, dtype and mode and writes the report. Modes:

``--mode compare`` (default)
    Build every contender once from one reference initialization (deepcopy), keep them all
    alive, and run them interleaved, A B C A B C ..., on the same batches: each round every
    contender does one full step (forward, backward, optimizer step, zero_grad) on the
    round's batch. Per contender: step-time median and spread over the measured rounds,
    tokens/s, forward/backward/optimizer split, persistent bytes per rank (weights,
    gradients, optimizer state), bytes sent per step by collective kind (one extra counted
    step, untimed), the global loss of every step, and for MFSDP the time spent inside its
    own hooks. Writes one JSON file (rank 0).

``--rss`` (with compare)
    Before anything else, fork one child process per (dtype, contender) that builds only
    that contender and runs a few steps: peak RSS (VmHWM, reset after the warm-up step) is
    process-wide, so each contender gets its own process. The children switch glibc to
    per-tensor mmap (``--rss-malloc mmap64k``) so that RSS follows live tensor memory.

``--mode sweep``
    Step time and persistent bytes per rank for every (layers, hidden) of a grid, for
    MFSDP ZeRO-3, FSDP2 and DDP (interleaved per grid point).

``--mode overlap``
    MFSDP ZeRO-3 with prefetch, without prefetch, with a prototype prefetch depth of 2,
    FSDP2 with and without explicit forward prefetch; plus compute-only (no wrapper, no
    communication) and communication-only (the step's collectives back to back) times.

Everything is CPU + gloo. Every rank uses ``--threads`` intra-op threads. This file is
the entry point; the parts: contenders.py (what runs), measurement.py and rss.py (what is
measured), modes.py (what a mode does with them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from contenders import ALL_CONTENDERS, DTYPES, REPO, Meshes, Options, base_name, dtype_name, resolve_spec  # noqa: E402
from measurement import log, rank, world  # noqa: E402
from modes import mode_compare, mode_overlap, mode_sweep  # noqa: E402
from rss import RSS_MALLOC, rss_phase  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("compare", "sweep", "overlap"), default="compare")
    p.add_argument("--contenders", type=lambda s: s.split(","), default=None,
                   help=f"comma-separated subset of {ALL_CONTENDERS} (default: all that fit the world size)")
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["fp32"],
                   help="comma-separated compute dtypes, run one after the other (fp32,bf16)")
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 warm-up + 2 steps (for a test)")
    for key in ("layers", "hidden", "heads", "vocab", "seq", "micro_batch"):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None,
                       help=f"model {key} (default: per dtype, see DEFAULT_CONFIGS)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds before the measured ones")
    p.add_argument("--steps", type=int, default=10, help="measured rounds (each contender one step per round)")
    p.add_argument("--rss", action="store_true", help="also measure peak RSS per contender (one child process each)")
    p.add_argument("--rss-warmup", type=int, default=1)
    p.add_argument("--rss-steps", type=int, default=2)
    p.add_argument("--rss-malloc", choices=sorted(RSS_MALLOC), default="mmap64k",
                   help="malloc setting of the peak-RSS children (mallopt after fork); 'inherit' keeps the launch's")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--no-foreach", action="store_true", help="for-loop AdamW instead of foreach (all contenders)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per rank (default cores // N, >= 1)")
    p.add_argument("--no-profile", action="store_true", help="skip the cProfile step")
    p.add_argument("--no-count-no-shard", action="store_true", help="skip the bytes-only MFSDP no_shard step")
    p.add_argument("--sweep-layers", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16])
    p.add_argument("--sweep-hidden", type=lambda s: [int(x) for x in s.split(",")], default=[128, 256])
    p.add_argument("--out", required=True, help="JSON file written by rank 0")
    args = p.parse_args(argv)
    for d in args.dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r}; use {sorted(DTYPES)}")
    for name in args.contenders or ():
        if base_name(name) not in ALL_CONTENDERS + ("mfsdp_no_shard",):
            p.error(f"unknown contender {name!r}; use {ALL_CONTENDERS}")
    if args.smoke:
        args.warmup, args.steps, args.rss_warmup, args.rss_steps = 1, 2, 1, 1
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    n = int(os.environ.get("WORLD_SIZE", "1"))
    threads = args.threads or max(1, (os.cpu_count() or 1) // n)
    torch.set_num_threads(threads)
    dtypes = [DTYPES[d] for d in args.dtypes]
    t0 = time.perf_counter()
    rss = rss_phase(args, dtypes, threads) if (args.rss and args.mode == "compare") else {}
    dist.init_process_group("gloo")
    meshes = Meshes()
    opts = Options(lr=args.lr, foreach=not args.no_foreach)
    result: dict = {"mode": args.mode, "world_size": world(), "argv": sys.argv[1:]}
    if args.mode == "compare":
        result["runs"] = {}
        for dtype in dtypes:
            spec = resolve_spec(args, dtype_name(dtype))
            log(f"compare world={world()} dtype={dtype_name(dtype)} threads/rank={threads} {spec.describe()}")
            result["runs"][dtype_name(dtype)] = mode_compare(args, spec, dtype, meshes, opts)
        result["rss"] = rss
    elif args.mode == "sweep":
        result.update(mode_sweep(args, dtypes[0], meshes, opts))
    else:
        spec = resolve_spec(args, dtype_name(dtypes[0]))
        log(f"overlap world={world()} dtype={dtype_name(dtypes[0])} {spec.describe()}")
        result.update(mode_overlap(args, spec, dtypes[0], meshes, opts))
    result["wall_s"] = time.perf_counter() - t0
    result["environment"] = {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "threads_per_rank": threads, "backend": dist.get_backend(),
        "allocator": allocator_description(),
        "engine": engine_version(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "optimizer": f"torch.optim.AdamW(lr={args.lr}, foreach={opts.foreach}) for every contender",
    }
    if rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        log(f"wrote {args.out} ({result['wall_s']:.1f}s)")
    dist.barrier()
    dist.destroy_process_group()


def engine_version() -> dict:
    """The git commit of the tree and whether the engine has uncommitted edits (read-only git)."""
    import subprocess

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    engine = os.path.join("megatron", "core", "distributed", "mfsdp_v2")
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "engine_last_commit": git("log", "-1", "--format=%h %s", "--", engine)[:120],
            "engine_dirty": bool(git("status", "--porcelain", "--", engine))}


def allocator_description() -> dict:
    """What serves tensor memory on CPU here: PyTorch's CPU allocator calls the C library's
    malloc (glibc unless LD_PRELOAD swaps it); MALLOC_* variables tune glibc."""
    env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"}
    return {"malloc": "glibc " + platform.libc_ver()[1] if platform.libc_ver()[0] == "glibc" else "unknown",
            "env": env}


if __name__ == "__main__":
    main()
