"""Peak RSS per contender. Peak RSS (VmHWM) is process-wide, so each contender runs in a
child forked from its rank before the rank touches torch.distributed: every child starts
from the same process image and owns its peak. The children switch glibc to per-tensor
mmap (``--rss-malloc mmap64k``), so RSS follows live tensor memory.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from contenders import (Meshes, ModelSpec, Options, build, build_reference, default_contenders, dtype_name,
                        make_batches, resolve_spec)
from measurement import gather_floats, world


def _status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (reported in kB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_bytes() -> int:
    return _status_bytes("VmRSS")


def hwm_bytes() -> int:
    """Peak RSS since the process started or since reset_hwm()."""
    return _status_bytes("VmHWM")


def reset_hwm() -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_rss(args, spec: ModelSpec, dtype: torch.dtype, meshes: Meshes, opts: Options, name: str) -> dict:
    """Peak RSS of one contender in this (fresh) process: VmHWM is reset after the warm-up
    steps (first optimizer step included, so its state is allocated), then the measured
    steps run; the result is the peak over those steps."""
    gc.collect()
    rss_start = rss_bytes()
    ref = build_reference(spec, args.seed, dtype)
    batches = make_batches(spec, args.rss_warmup + args.rss_steps, args.seed + 1)
    c = build(name, ref, dtype, meshes, opts)
    del ref
    gc.collect()
    rss_built = rss_bytes()
    hwm_ok = True
    for i, (inputs, labels) in enumerate(batches):
        if i == args.rss_warmup:
            gc.collect()
            hwm_ok = reset_hwm()
        dist.barrier()
        c.step(inputs, labels)
    peak = hwm_bytes()
    rss_end = rss_bytes()
    rows = gather_floats([peak, rss_start, rss_built, rss_end])
    per_rank = [dict(zip(("peak_rss", "rss_start", "rss_after_build", "rss_end"), r)) for r in rows]
    return {
        "contender": name, "dtype": dtype_name(dtype), "world_size": world(), "model": dataclasses.asdict(spec),
        "warmup": args.rss_warmup, "steps": args.rss_steps, "hwm_reset": hwm_ok, "per_rank": per_rank,
        "peak_rss_max": max(p["peak_rss"] for p in per_rank),
        "peak_over_start_max": max(p["peak_rss"] - p["rss_start"] for p in per_rank),
    }



# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


RSS_MALLOC = {
    # Every allocation of 64 KiB or more is its own mmap, returned to the OS when freed:
    # RSS then follows live tensor memory, not what the allocator keeps cached.
    "mmap64k": ((_M_MMAP_THRESHOLD, 65536), (_M_TRIM_THRESHOLD, 131072)),
    "inherit": (),
}


def set_malloc(setting: str) -> bool:
    """Apply a glibc malloc setting to this process at run time (mallopt)."""
    params = RSS_MALLOC[setting]
    if not params:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return all(libc.mallopt(param, value) == 1 for param, value in params)
    except OSError:
        return False


def run_forked(store: str, malloc: str, threads: int, work: Callable[[], dict]) -> Optional[dict]:
    """Run ``work()`` in a child forked from this rank *before* the rank joins any process
    group or runs any torch op, so every child starts from the same process image (imports
    only) and owns its peak RSS. The children of all ranks form their own gloo group
    through a FileStore at ``store``. Returns rank 0's result (None on other ranks)."""
    rank_, world_ = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result_file = store + ".json"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            import datetime

            malloc_ok = set_malloc(malloc)
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank_, world_size=world_,
                                    timeout=datetime.timedelta(seconds=600))
            torch.set_num_threads(threads)
            result = work()
            result["malloc"] = {"setting": malloc, "applied": malloc_ok,
                                "inherited_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}
            if rank_ == 0:
                with open(result_file, "w") as f:
                    json.dump(result, f)
            dist.barrier()
            dist.destroy_process_group()
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise RuntimeError(f"child process ({os.path.basename(store)}) failed with status {status}")
    if rank_ != 0:
        return None
    with open(result_file) as f:
        result = json.load(f)
    os.remove(result_file)
    if os.path.exists(store):
        os.remove(store)
    return result


def rss_phase(args, dtypes: List[torch.dtype], threads: int) -> dict:
    """Peak RSS per contender, each in its own forked process (run_forked)."""
    world_ = int(os.environ["WORLD_SIZE"])
    run_id = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}_{os.environ.get('MASTER_PORT', '0')}"
    out: Dict[str, Dict[str, dict]] = {}
    for dtype in dtypes:
        spec = resolve_spec(args, dtype_name(dtype))
        names = args.contenders or default_contenders(world_)
        for name in names:
            store = f"/tmp/mfsdp_bench_rss_{run_id}_{dtype_name(dtype)}_{name}"
            opts = Options(lr=args.lr, foreach=not args.no_foreach)
            r = run_forked(store, args.rss_malloc, threads,
                           lambda: measure_rss(args, spec, dtype, Meshes(), opts, name))
            if r is not None:
                out.setdefault(dtype_name(dtype), {})[name] = r
                print(f"[compare_dp {time.strftime('%H:%M:%S')}] peak RSS {dtype_name(dtype)} {name}: "
                      f"{r['peak_rss_max'] / 2**20:.1f} MiB/rank (+{r['peak_over_start_max'] / 2**20:.1f} over start)", flush=True)
    return out
