#!/usr/bin/env python
"""Driver: runs compare_dp.py under torch.distributed.run for every world size and writes
the report (Markdown, JSON, PNG) into ``--out`` (default ``benchmarks/results``).

    python benchmarks/run_compare.py                  # comparison: N = 2, 4; fp32, bf16; peak RSS
    python benchmarks/run_compare.py --sweep          # + scaling sweep (layers x hidden)
    python benchmarks/run_compare.py --overlap        # + prefetch/overlap figure
    python benchmarks/run_compare.py --all --update-readme   # everything, README block refreshed
    python benchmarks/run_compare.py --smoke --out /tmp/bench  # tiny, N=2 only, ~1 minute (for a test)

Every launch gets the same environment: OMP_NUM_THREADS = cores // N (at least 1) and
the allocator setting of ``--malloc`` (the same for every contender; it is recorded in
the JSON). Each launch has a time limit so a hung rank cannot hang the driver.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import report  # noqa: E402

MALLOC_SETTINGS = {
    # glibc as a caching allocator: nothing below 32 MiB (the largest threshold glibc
    # accepts) is mmapped, and the heap is never trimmed, so freed tensor memory is reused
    # instead of being returned to the OS and faulted in again. Closest to what a GPU
    # caching allocator does; RSS is then the heap's high-water mark.
    "cache": {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "17179869184"},
    # Every tensor of 64 KiB or more gets its own mmap and goes back to the OS when freed,
    # so RSS follows live tensor memory instead of what glibc happens to cache.
    "mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536"},
    # glibc as shipped (dynamic mmap threshold up to 32 MiB: freed memory may stay cached).
    "default": {},
}


def launch(nproc: int, worker_args, out_json: str, malloc: str, timeout: int, log_dir: str, command: str) -> dict:
    env_extra = dict(MALLOC_SETTINGS[malloc])
    env = dict(os.environ)
    env.update(env_extra)
    for key in list(env):
        if key.startswith("MALLOC_") and key not in env_extra:
            del env[key]
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--log-dir", os.path.join(log_dir, f"{os.path.basename(out_json)}.logs"), "--redirects", "3", "--tee", "3",
           "--local-ranks-filter", "0",
           os.path.join(HERE, "compare_dp.py"), *worker_args, "--out", out_json]
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    t = time.time()
    load_before = os.getloadavg()
    proc = subprocess.run(cmd, env=env, cwd=REPO, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"launch failed (exit {proc.returncode}); rank logs under {log_dir}")
    print(f"  done in {time.time() - t:.0f}s, load {os.getloadavg()[0]:.2f}", flush=True)
    with open(out_json) as f:
        result = json.load(f)
    # Which driver command made this file, with what environment and under what load.
    result["driver"] = {"command": command, "malloc": malloc, "launch": " ".join(shlex.quote(c) for c in cmd),
                        "env": {k: env[k] for k in sorted(env_extra) + ["OMP_NUM_THREADS"]},
                        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                        "wall_s": time.time() - t, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1)
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--world-sizes", default=None, help="comma-separated (default 2,4; with --smoke 2)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child processes")
    p.add_argument("--no-compare", action="store_true", help="skip the main comparison")
    p.add_argument("--sweep", action="store_true", help="scaling sweep (world size --sweep-world-size)")
    p.add_argument("--sweep-world-size", type=int, default=2)
    p.add_argument("--sweep-layers", default="4,8,16")
    p.add_argument("--sweep-hidden", default="128,256")
    p.add_argument("--sweep-steps", type=int, default=5)
    p.add_argument("--overlap", action="store_true", help="prefetch/overlap figure (fp32, every world size)")
    p.add_argument("--optimizations", action="store_true",
                   help="before/after run of the engine prototypes (prototypes.py) against the stock engine")
    p.add_argument("--prototypes", default="inflight0,inflight2,no_fwd_prefetch",
                   help="variants of ZeRO-3 measured by --optimizations against the stock engine, comma-separated: "
                        "prototypes.py names ('+' combines them) and '@REV' for the engine at git revision REV "
                        "(engine_snapshot.py), e.g. @HEAD~1 for the engine before the last commit")
    p.add_argument("--optim-extra", default="",
                   help="more contenders for the --optimizations run, comma-separated, e.g. mfsdp_zero2,ddp")
    p.add_argument("--allocators", default=None,
                   help="comma-separated --malloc settings for an allocator-sensitivity run (N=2, fp32, "
                        "ZeRO-3 / FSDP2 / DDP, with peak RSS), e.g. default,mmap64k")
    p.add_argument("--allocator-contenders", default="mfsdp_zero3,fsdp2,ddp",
                   help="contenders of the allocator-sensitivity run")
    p.add_argument("--all", action="store_true", help="comparison + optimizations + sweep + overlap")
    p.add_argument("--malloc", choices=sorted(MALLOC_SETTINGS), default="cache",
                   help="glibc malloc setting for every launch and every contender (see MALLOC_SETTINGS)")
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 warm-up + 2 steps, N=2 unless --world-sizes (a test can call this)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per launch")
    p.add_argument("--update-readme", action="store_true", help="rewrite the results block of benchmarks/README.md")
    p.add_argument("worker_args", nargs="*", help="extra arguments for compare_dp.py after --, e.g. -- --hidden 512")
    args = p.parse_args(argv)
    if args.all:
        args.sweep = args.overlap = args.optimizations = True
    if args.world_sizes is None:
        args.world_sizes = "2" if args.smoke else "2,4"
    if args.smoke:  # a tiny grid too
        args.sweep_layers, args.sweep_hidden = "1,2", "32"
    os.makedirs(args.out, exist_ok=True)
    log_dir = os.path.join(args.out, "logs")
    os.makedirs(log_dir, exist_ok=True)
    env_extra = dict(MALLOC_SETTINGS[args.malloc])
    common = ["--warmup", str(args.warmup), "--steps", str(args.steps)] + (["--smoke"] if args.smoke else [])
    common += args.worker_args
    world_sizes = [int(x) for x in args.world_sizes.split(",")]
    command = "python benchmarks/run_compare.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    t0 = time.time()
    meta = {"command": command, "malloc_setting": args.malloc, "malloc_env": env_extra,
            "loadavg_start": os.getloadavg(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    compare = {}
    if not args.no_compare:
        for n in world_sizes:
            worker = ["--mode", "compare", "--dtypes", args.dtypes] + ([] if args.no_rss else ["--rss"]) + common
            compare[n] = launch(n, worker, os.path.join(args.out, f"compare_n{n}.json"), args.malloc, args.timeout, log_dir, command)
    sweep = None
    if args.sweep:
        worker = ["--mode", "sweep", "--dtypes", "fp32", "--sweep-layers", args.sweep_layers,
                  "--sweep-hidden", args.sweep_hidden] + common
        if not args.smoke:
            worker += ["--warmup", "1", "--steps", str(args.sweep_steps)]
        sweep = launch(args.sweep_world_size, worker, os.path.join(args.out, "sweep.json"), args.malloc, args.timeout, log_dir, command)
    overlap = {}
    if args.overlap:
        for n in world_sizes:
            worker = ["--mode", "overlap", "--dtypes", "fp32"] + common
            overlap[n] = launch(n, worker, os.path.join(args.out, f"overlap_n{n}.json"), args.malloc, args.timeout, log_dir, command)
    optim = {}
    if args.optimizations:
        variants = args.prototypes.split(",")
        names = ["mfsdp_zero3"] + [f"mfsdp_zero3{v}" if v.startswith("@") else f"mfsdp_zero3+{v}" for v in variants]
        names += [name for name in args.optim_extra.split(",") if name] + ["fsdp2"]
        for n in world_sizes:
            worker = ["--mode", "compare", "--dtypes", args.dtypes, "--contenders", ",".join(names), "--no-profile",
                      "--no-count-no-shard"] + ([] if args.no_rss else ["--rss"]) + common
            optim[n] = launch(n, worker, os.path.join(args.out, f"optim_n{n}.json"), args.malloc, args.timeout, log_dir, command)
    alloc = {}
    if args.allocators:
        for setting in args.allocators.split(","):
            worker = ["--mode", "compare", "--dtypes", "fp32", "--contenders", args.allocator_contenders, "--rss",
                      "--rss-malloc", "inherit",
                      "--no-profile", "--no-count-no-shard"] + common
            alloc[setting] = launch(2, worker, os.path.join(args.out, f"alloc_{setting}_n2.json"),
                                    setting, args.timeout, log_dir, command)
    meta["loadavg_end"] = os.getloadavg()
    meta["wall_s"] = time.time() - t0
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    paths = report.write_report(args.out, meta)
    print("report: " + ", ".join(paths), flush=True)
    if args.update_readme:
        report.update_readme(os.path.join(HERE, "README.md"), os.path.join(args.out, "report.md"), args.out)
        print("README.md results block updated", flush=True)


if __name__ == "__main__":
    main()
