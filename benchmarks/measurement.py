"""What the benchmark measures, besides the step times that ``Contender.step`` takes:
summaries over ranks, persistent bytes, the analytic and the counted bytes per collective
(a tap on the ``torch.distributed`` functions), time inside MFSDP's hooks (the engine's
profiler ranges) and cProfile self time of a wrapper's Python. Peak RSS: rss.py.
"""

from __future__ import annotations

import cProfile
import copy
import functools
import importlib
import os
import pstats
import statistics
import time
import warnings
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from cpu_time_ledger import CpuTimeLedger
from megatron.core.models.gpt.model_stats import flops_per_token

if TYPE_CHECKING:  # contenders.py imports this module
    from contenders import Contender, ModelSpec

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def log(msg: str) -> None:
    if rank() == 0:
        print(f"[compare_dp {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def storage_bytes(tensors, seen: Optional[set] = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = local(t).untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def gather_floats(values: List[float]) -> List[List[float]]:
    """Every rank's list (same length on every rank) -> [rank][i]."""
    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(world())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def summarize(times: List[float]) -> dict:
    s = sorted(times)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
    return {
        "median": statistics.median(s),
        "min": s[0],
        "max": s[-1],
        "p25": q[0],
        "p75": q[2],
        "iqr": q[2] - q[0],
        "mean": statistics.fmean(s),
        "stdev": statistics.stdev(s) if len(s) > 1 else 0.0,
        "n": len(s),
    }


def timing_summary(c: Contender, global_tokens: int, spec: ModelSpec) -> dict:
    """Step time of a step = the slowest rank's time for that step."""
    out = {}
    for key in ("step", "forward", "backward", "optimizer", "page_faults"):
        per_rank = gather_floats([t[key] for t in c.times])
        slowest = [max(col) for col in zip(*per_rank)]
        out[key] = summarize(slowest)
        if key == "step":
            out["step_times"] = slowest
    med = out["step"]["median"]
    out["tokens_per_s"] = global_tokens / med
    out["model_tflops_per_s"] = flops_per_token(spec.config(), spec.vocab, spec.seq) * global_tokens / med / 1e12
    return out


def elsize(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def expected_bytes(spec: ModelSpec, dtype: torch.dtype, name: str, n: int) -> dict:
    """Analytic bytes sent per rank per step (ring algorithm, see wire_bytes).

    ``issue_rule`` is the issue's target (ZeRO-3: 3 P (N-1)/N, no_shard: 2 P (N-1)/N).
    ``precise`` also counts that a root unit is not resharded between its forward and its
    backward (MFSDP and FSDP2 alike), so the root's parameters (embeddings, final norm) are
    all-gathered once per step, not twice; the layout's row padding is what is left."""
    e = elsize(dtype)
    p = spec.num_params()
    p_root = spec.vocab * spec.hidden + spec.seq * spec.hidden + 2 * spec.hidden
    p_layers = p - p_root
    f = (n - 1) / n
    out = {"param_numel": p, "root_numel": p_root, "param_bytes": p * e}
    if name in ("mfsdp_zero3", "fsdp2"):
        out.update(issue_rule="3 P (N-1)/N", issue_bytes=3 * p * e * f, precise=(2 * p_layers + p_root + p) * e * f)
    elif name in ("mfsdp_zero2", "mfsdp_no_shard"):
        rule = "RS + AG after the step: 2 P (N-1)/N" if name == "mfsdp_zero2" else "all-reduce: 2 P (N-1)/N"
        out.update(issue_rule=rule, issue_bytes=2 * p * e * f, precise=2 * p * e * f)
    elif name == "ddp":
        out.update(issue_rule="all-reduce of fp32 grads: 2 P4 (N-1)/N", issue_bytes=2 * p * 4 * f, precise=2 * p * 4 * f)
    elif name == "mfsdp_hsdp":
        inner, outer = 2, n // 2
        fi, fo = (inner - 1) / inner, (outer - 1) / outer
        out.update(issue_rule="inner 3 P (I-1)/I + outer all-reduce of the shard 2 (P/I) (O-1)/O",
                   issue_bytes=3 * p * e * fi + 2 * (p / inner) * e * fo,
                   precise=(2 * p_layers + p_root + p) * e * fi + 2 * (p / inner) * e * fo)
    return out


def padding_bound(c: Contender) -> Optional[dict]:
    """MFSDP: persistent bytes vs 1/N of the unsharded total; the slack must stay below one
    row of the largest tensor per parameter group."""
    if c.kind != "mfsdp":
        return None
    slack_numel, bound_numel, total_numel = 0.0, 0, 0
    for unit in c.ctx.units:
        for group in unit.parameter_groups:
            layout = group.layout
            total_numel += layout.total_numel
            slack_numel += layout.shard_numel - layout.total_numel / layout.num_shards
            bound_numel += max(layout.row_numels) if layout.row_numels else 0
    return {"unsharded_numel": total_numel, "shards": c.shard_size,
            "padding_numel_per_rank": slack_numel, "one_row_per_group_numel": bound_numel,
            "within_bound": slack_numel < bound_numel}


_COUNTED_FUNCTIONS = {
    # name in torch.distributed -> (kind, which argument holds what this rank contributes)
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    # MFSDP on gloo (mfsdp_v2/gloo_wire.py): all-gathers and reduce-scatters as
    # point-to-point sends.
    "isend": "send",
}


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else world()


def wire_bytes(kind: str, input_bytes: int, size: int) -> float:
    """Bytes one rank sends for a collective under the bandwidth-optimal (ring) algorithm.

    all_gather: contributes ``input_bytes`` (its shard), sends (N-1) shards.
    reduce_scatter: contributes ``input_bytes`` (the full buffer), sends (N-1)/N of it.
    all_reduce: reduce-scatter + all-gather of the buffer, 2 (N-1)/N of it.
    send: one point-to-point message, all of it."""
    if kind == "send":
        return float(input_bytes)
    if size <= 1:
        return 0.0
    if kind == "all_gather":
        return input_bytes * (size - 1)
    if kind == "reduce_scatter":
        return input_bytes * (size - 1) / size
    if kind == "all_reduce":
        return 2 * input_bytes * (size - 1) / size
    return input_bytes * (size - 1) / size


class CollectiveTap:
    """Wraps the torch.distributed functions FSDP2 and MFSDP call, records
    (kind, bytes this rank contributes, group size). Only installed for a counted step."""

    def __init__(self):
        self.records: List[tuple] = []
        self._saved: Dict[str, Callable] = {}

    def _wrap(self, name: str, fn: Callable, kind: str) -> Callable:
        import inspect

        signature = inspect.signature(fn)
        contributed = {"all_gather": ("input_tensor",), "reduce_scatter": ("input",)}.get(kind, ("tensor",))

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            tensor = next((bound.arguments[k] for k in contributed if k in bound.arguments), None)
            nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
            self.records.append((kind, nbytes, _group_size(bound.arguments.get("group"))))
            return fn(*args, **kwargs)

        return wrapper

    def __enter__(self):
        for name, kind in _COUNTED_FUNCTIONS.items():
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn
            setattr(dist, name, self._wrap(name, fn, kind))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()


def summarize_records(records) -> dict:
    by_kind: Dict[str, dict] = {}
    for kind, nbytes, size in records:
        entry = by_kind.setdefault(kind, {"calls": 0, "input_bytes": 0, "wire_bytes": 0.0})
        entry["calls"] += 1
        entry["input_bytes"] += nbytes
        entry["wire_bytes"] += wire_bytes(kind, nbytes, size)
    total = sum(e["wire_bytes"] for e in by_kind.values())
    return {"by_kind": by_kind, "wire_bytes_total": total}


def count_collectives(c, batch) -> dict:
    """One extra, untimed step with the collective tap installed.

    DDP reduces from C++ (its Reducer), which no Python wrapper sees: it is counted on a
    throw-away DDP copy with a counting communication hook that does what DDP's default
    does (all-reduce each bucket, divide by N)."""
    inputs, labels = batch
    if c.kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        records = []
        probe = DistributedDataParallel(copy.deepcopy(c.model.module), gradient_as_bucket_view=True)

        def hook(state, bucket):
            buffer = bucket.buffer()
            records.append(("all_reduce", buffer.numel() * buffer.element_size(), world()))
            fut = dist.all_reduce(buffer, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0].div_(world()))

        probe.register_comm_hook(None, hook)
        with torch.autocast("cpu", dtype=c.dtype, enabled=c.autocast):
            probe(inputs, labels=labels).mean().backward()
        del probe
        return summarize_records(records)
    tap = CollectiveTap()
    engine_before = len(c.ctx.counter.records) if c.kind == "mfsdp" else 0
    with tap:
        c.step(inputs, labels)
    out = summarize_records(tap.records)
    if c.kind == "mfsdp":
        engine_records = [(r.kind, r.bytes, r.group_size) for r in c.ctx.counter.records[engine_before:]]
        out["engine_counter"] = summarize_records(engine_records)
        c.ctx.counter.reset()
    return out


HOOK_RANGE_PREFIX = "MFSDP "
HOOK_NAMES = ("pre_forward", "post_forward", "pre_backward", "post_backward", "finish_backward")
# Ranges nested in (or next to) the hooks, see mfsdp_v2/profiling.py and work.py.
WAIT_PREFIX, POST_OPS_PREFIX, STASH_NAME = "MFSDP wait ", "MFSDP post_ops ", "MFSDP stash_grad"


def _outermost(events) -> list:
    """The ranges not nested in another one of the same thread (a hook run inside another
    hook, e.g. a unit's post_backward inside the end of backward, counts once)."""
    out, ends = [], {}
    for e in sorted(events, key=lambda e: (e.thread, e.time_range.start)):
        if e.time_range.start >= ends.get(e.thread, float("-inf")):
            out.append(e)
            ends[e.thread] = e.time_range.end
    return out


def _inside(event, outer) -> bool:
    return any(o.thread == event.thread and o.time_range.start <= event.time_range.start
               and event.time_range.end <= o.time_range.end for o in outer)


def hook_overhead(c, batch, steps: int) -> Optional[dict]:
    """Where the engine's time goes, per step, from its own profiler ranges: ``steps``
    untimed steps under torch.profiler (CPU).

    * hooks: wall time inside ``MFSDP <unit> <hook>`` and ``MFSDP finish_backward``
      (outermost ranges; unshard, reshard, launching and waiting for collectives, the
      reductions' post-ops),
    * waits: the host blocked on a collective (``MFSDP wait <kind>``), inside the hooks
      (exposed communication) or outside (e.g. the optimizer's post-step all-gather),
    * post-ops and gradient stashing (``MFSDP post_ops <kind>``, ``MFSDP stash_grad``, the
      per-gradient copy into the reduce buffer that runs in autograd's hook),
    * own: the engine's own work = hooks - waits inside hooks + stashing and post-ops
      outside hooks (Python, launches, copies, divisions).

    The profiler's per-operator bookkeeping inflates every figure a little, the same for
    every engine. None for an engine without ranges (a snapshot from before they existed)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            c.step(*batch)
        wall = time.perf_counter() - t
    events = [e for e in prof.events() if e.name.startswith(HOOK_RANGE_PREFIX)]
    hooks = _outermost([e for e in events if e.name.rsplit(" ", 1)[-1] in HOOK_NAMES])
    if not hooks:
        return None

    def per_step(es) -> float:
        return sum(e.time_range.elapsed_us() for e in es) / 1e6 / steps

    by_hook: Dict[str, float] = {}
    for e in hooks:
        hook = e.name.rsplit(" ", 1)[-1]
        by_hook[hook] = by_hook.get(hook, 0.0) + e.time_range.elapsed_us() / 1e6 / steps
    waits = [e for e in events if e.name.startswith(WAIT_PREFIX)]
    extra = _outermost([e for e in events if e.name.startswith(POST_OPS_PREFIX) or e.name == STASH_NAME])
    wait_in = {k: per_step([e for e in waits if e.name == WAIT_PREFIX + k and _inside(e, hooks)])
               for k in sorted({e.name[len(WAIT_PREFIX):] for e in waits})}
    wait_out = {k: per_step([e for e in waits if e.name == WAIT_PREFIX + k and not _inside(e, hooks)])
                for k in wait_in}
    extra_out = [e for e in extra if not _inside(e, hooks)]
    hook_s = sum(by_hook.values())
    own_s = hook_s - sum(wait_in.values()) + per_step(extra_out)
    units = len(c.ctx.units)
    return {
        "steps": steps, "units": units, "step_wall_s": wall / steps, "source": "torch.profiler ranges 'MFSDP ...'",
        "hook_s_per_step": hook_s, "hook_s_per_unit_per_step": hook_s / units,
        "by_hook_s_per_step": by_hook, "ranges_per_step": len(hooks) / steps,
        "wait_in_hooks_s_per_step": wait_in, "wait_outside_hooks_s_per_step": wait_out,
        "post_ops_s_per_step": per_step([e for e in extra if e.name.startswith(POST_OPS_PREFIX)]),
        "stash_s_per_step": per_step([e for e in extra if e.name == STASH_NAME]),
        "own_s_per_step": own_s, "own_s_per_unit_per_step": own_s / units,
    }


def engine_cpu_time(c, batch, steps: int) -> Optional[dict]:
    """The engine's own CPU time without a profiler: ``steps`` untimed steps with a
    ``CpuTimeLedger`` (cpu_time_ledger.py) observing the context's ranges, which adds up the training
    thread's CPU time inside the outermost engine ranges (the hooks, and the gradient
    stashing, launches and post-ops that run outside them) and inside the waits among them. Own CPU = the first minus the second:
    Python, launches (gloo's sends and receives run partly on this thread), copies,
    sums and divisions, but not the time the thread was blocked or descheduled, which the
    wall time of the same ranges (also given) includes. None for an engine without it."""
    handle = getattr(c.ctx, "device_handle", None)
    if handle is not None and hasattr(handle, "range_observer"):  # set on the measured context only
        ledger = CpuTimeLedger()
        handle.range_observer = ledger.measure
        try:
            for _ in range(steps):
                c.step(*batch)
        finally:
            handle.range_observer = None
    else:  # an engine revision with a process-wide ledger of its own
        try:
            profiling = importlib.import_module(c.engine.__name__ + ".profiling")
        except ImportError:
            return None
        if not hasattr(profiling, "CpuTimeLedger"):
            return None
        ledger = profiling.CpuTimeLedger()
        profiling.record_cpu_time(ledger)
        try:
            for _ in range(steps):
                c.step(*batch)
        finally:
            profiling.record_cpu_time(None)
    units = len(c.ctx.units)
    own_cpu, own_wall = ledger.cpu_s - ledger.wait_cpu_s, ledger.wall_s - ledger.wait_wall_s
    return {
        "steps": steps, "units": units, "source": "thread CPU time in the engine's ranges (CpuTimeLedger)",
        "ranges_per_step": ledger.ranges / steps,
        "own_cpu_s_per_step": own_cpu / steps, "own_cpu_s_per_unit_per_step": own_cpu / steps / units,
        "own_wall_s_per_step": own_wall / steps, "own_wall_s_per_unit_per_step": own_wall / steps / units,
        "wait_cpu_s_per_step": ledger.wait_cpu_s / steps, "wait_wall_s_per_step": ledger.wait_wall_s / steps,
    }


_ENGINE_DIRS = {
    "mfsdp": os.path.join("megatron", "core", "distributed", "mfsdp_v2"),
    "fsdp2": os.path.join("torch", "distributed", "fsdp", "_fully_shard"),
    "ddp": os.path.join("torch", "nn", "parallel"),
}


_DTENSOR_DIR = os.path.join("torch", "distributed", "tensor")


def profile_python_self_time(c: Contender, batch) -> dict:
    """cProfile one step: self time (tottime) of Python frames in the wrapper's own source
    files, and in DTensor's. cProfile slows Python down, so these are upper bounds; use
    them to compare engines, not as absolute costs."""
    inputs, labels = batch
    prof = cProfile.Profile()
    prof.enable()
    t = time.perf_counter()
    c.step(inputs, labels)
    wall = time.perf_counter() - t
    prof.disable()
    stats = pstats.Stats(prof)
    engine_dir = os.path.dirname(c.engine.__file__) if c.kind == "mfsdp" else _ENGINE_DIRS.get(c.kind)
    engine, dtensor, top = 0.0, 0.0, []
    for (filename, line, fn), (cc, nc, tottime, cumtime, callers) in stats.stats.items():
        if engine_dir and engine_dir in filename:
            engine += tottime
            top.append((tottime, f"{os.path.basename(filename)}:{line}({fn})", nc))
        elif _DTENSOR_DIR in filename:
            dtensor += tottime
    top.sort(reverse=True)
    return {
        "profiled_step_s": wall,
        "engine_python_self_s": engine,
        "dtensor_python_self_s": dtensor,
        "top_engine_functions": [{"self_s": s, "function": f, "calls": n} for s, f, n in top[:12]],
    }
