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

Everything is CPU + gloo. Every rank uses ``--threads`` intra-op threads.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
import copy
import cProfile
import dataclasses
import functools
import gc
import json
import math
import os
import platform
import pstats
import resource
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megatron.core.distributed import mfsdp_v2  # noqa: E402
from megatron.core.distributed.mfsdp_v2 import MixedPrecisionPolicy  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.model_stats import flops_per_token, num_parameters  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

ALL_CONTENDERS = ("mfsdp_zero3", "mfsdp_zero2", "mfsdp_hsdp", "fsdp2", "ddp")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Default model configs. bf16 matmuls on a CPU without AVX512-BF16/AMX run through a scalar
# fallback (~50x slower than fp32 here, see README), so the bf16 default is smaller.
DEFAULT_CONFIGS = {
    "fp32": dict(layers=8, hidden=640, heads=10, vocab=16384, seq=128, micro_batch=2),  # 50.0M parameters
    "bf16": dict(layers=4, hidden=128, heads=4, vocab=2048, seq=64, micro_batch=2),
}
SMOKE_CONFIG = dict(layers=2, hidden=32, heads=2, vocab=128, seq=16, micro_batch=2)


# --------------------------------------------------------------------------------------
# Small utilities
# --------------------------------------------------------------------------------------


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


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_hwm() -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


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


# --------------------------------------------------------------------------------------
# Model and data
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class ModelSpec:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    micro_batch: int

    def config(self) -> TransformerConfig:
        return TransformerConfig(num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads)

    def num_params(self) -> int:
        return num_parameters(self.config(), self.vocab, self.seq)

    def describe(self) -> str:
        return (f"GPT L={self.layers} h={self.hidden} heads={self.heads} ffn={4 * self.hidden} "
                f"vocab={self.vocab} seq={self.seq} micro_batch/rank={self.micro_batch} "
                f"params={self.num_params() / 1e6:.2f}M (tied embeddings, learned positions, LayerNorm, GELU)")


def build_reference(spec: ModelSpec, seed: int, dtype: torch.dtype) -> GPTModel:
    """The one initialization every contender copies. For bf16 the weights are rounded to
    bf16-representable values, so fp32 main weights (MFSDP) and fp32 params (FSDP2, DDP)
    start from exactly the values the bf16 compute copy holds."""
    torch.manual_seed(seed)
    model = GPTModel(spec.config(), spec.vocab, spec.seq)
    if dtype != torch.float32:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype).float())
    return model


def make_batches(spec: ModelSpec, count: int, seed: int):
    """A learnable synthetic language (so losses fall and a wrong gradient shows): each next
    token follows a fixed random permutation of the previous one with probability 0.8, else
    it is uniform. The global batch of step i is the same for every contender; each rank
    takes its rows."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(spec.vocab, generator=g)
    n_rows = world() * spec.micro_batch
    batches = []
    for _ in range(count):
        tokens = torch.empty(n_rows, spec.seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, spec.vocab, (n_rows,), generator=g)
        noise = torch.randint(0, spec.vocab, (n_rows, spec.seq), generator=g)
        follow = torch.rand(n_rows, spec.seq, generator=g) < 0.8
        for t in range(spec.seq):
            tokens[:, t + 1] = torch.where(follow[:, t], perm[tokens[:, t]], noise[:, t])
        rows = tokens[rank() * spec.micro_batch:(rank() + 1) * spec.micro_batch]
        batches.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
    return batches


# --------------------------------------------------------------------------------------
# Contenders
# --------------------------------------------------------------------------------------


class Meshes:
    def __init__(self):
        self.flat = init_device_mesh("cpu", (world(),), mesh_dim_names=("dp",))
        self.hsdp = None
        if world() >= 4 and world() % 2 == 0:
            self.hsdp = init_device_mesh("cpu", (world() // 2, 2), mesh_dim_names=("outer", "inner"))


@dataclasses.dataclass
class Options:
    lr: float = 1e-3
    foreach: bool = True
    fsdp2_forward_prefetch: bool = False
    mfsdp_prefetch: int = 1  # 0 = none, 1 = engine default, 2 = prototype depth 2


class Contender:
    """One wrapped model, its optimizer and how to run a step."""

    def __init__(self, name: str, model: nn.Module, optimizer, dtype: torch.dtype, kind: str, ctx=None,
                 autocast: bool = False, shard_size: int = 1, engine=mfsdp_v2):
        self.name = name
        self.engine = engine  # the MFSDP package (the working tree's, or a snapshot at a revision)
        self.model = model
        self.optimizer = optimizer
        self.dtype = dtype
        self.kind = kind  # "mfsdp" | "fsdp2" | "ddp" | "plain"
        self.ctx = ctx
        self.autocast = autocast
        self.shard_size = shard_size
        self.times: List[dict] = []
        self.losses: List[float] = []
        self.persistent: Optional[dict] = None

    def _forward_scope(self):
        if self.kind == "mfsdp":
            return self.engine.microbatch(self.ctx, is_last=True)
        if self.autocast:
            return torch.autocast("cpu", dtype=self.dtype)
        return contextlib.nullcontext()

    def step(self, inputs, labels, measure_memory: bool = False) -> dict:
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        with self._forward_scope():
            loss = self.model(inputs, labels=labels).mean()
            t1 = time.perf_counter()
            loss.backward()
        t2 = time.perf_counter()
        if measure_memory:
            self.persistent = self.persistent_bytes()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        # Minor page faults of the whole process (gloo threads included) during the step:
        # first touches of freshly mapped memory, i.e. what the allocator did not reuse.
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        return {"loss": loss.item(), "step": t3 - t0, "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2,
                "page_faults": float(faults)}

    # Memory -----------------------------------------------------------------------------
    def optimizer_state_tensors(self):
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value

    def persistent_bytes(self) -> dict:
        """Per-rank bytes of weights, gradients and optimizer state, measured after the
        backward (gradients alive) and before the optimizer step's zero_grad. Optimizer
        state is read after at least one step, so the caller measures from step 2 on."""
        opt = storage_bytes(self.optimizer_state_tensors())
        if self.kind == "mfsdp":
            engine = self.ctx.persistent_bytes()
            weights = engine.get("main_weight", 0) + engine.get("model_weight", 0)
            grads = engine.get("main_grad", 0)
            detail = dict(engine)
        else:
            params = list(self.model.parameters())
            weights = storage_bytes(params)
            grads = storage_bytes([p.grad for p in params])
            detail = {}
        return {"weights": weights, "grads": grads, "optimizer": opt, "total": weights + grads + opt, "detail": detail}


def _mfsdp_policy(dtype: torch.dtype, engine=mfsdp_v2) -> Optional[MixedPrecisionPolicy]:
    if dtype == torch.float32:
        return None
    # Same numerics as FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) over
    # fp32 parameters: bf16 compute and all-gather, bf16 reduce-scatter, fp32 gradients,
    # fp32 main weights.
    return engine.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
                                       grad_comm_dtype=dtype)


def _set_prefetch_depth(ctx, depth: int) -> None:
    """0: no prefetch; 1: the engine's own (default); 2: prototype of a deeper prefetch
    (issue the all-gathers of the next two units). Benchmark-only instance patches."""
    if depth == 1:
        return
    if depth == 0:
        ctx.prefetch_forward = lambda unit: None
        ctx.prefetch_backward = lambda unit: None
        return

    def prefetch_after(unit, order, index_attr):
        index = getattr(unit._fsdp_state, index_attr)
        for nxt in range(index + 1, min(index + 1 + depth, len(order))):
            order[nxt]._fsdp_state.issue_unshard()

    ctx._prefetch_after = prefetch_after


def build_mfsdp(name: str, ref: nn.Module, dtype: torch.dtype, placements: Callable, mesh, opts: Options,
                shard_size: int, engine=mfsdp_v2) -> Contender:
    """``placements(engine.Placements)`` gives the placements, so a snapshot engine gets its own."""
    model = copy.deepcopy(ref)
    if dtype != torch.float32:
        model = model.to(dtype)
    policy = _mfsdp_policy(dtype, engine)
    placements = placements(engine.Placements)
    with engine.fully_shard_context(device="cpu") as ctx:
        for layer in model.decoder.layers:
            engine.fully_shard(layer, mesh=mesh, placements=placements, mixed_precision_policy=policy)
        engine.fully_shard(model, mesh=mesh, placements=placements, mixed_precision_policy=policy)
    _set_prefetch_depth(ctx, opts.mfsdp_prefetch)
    optimizer = engine.fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=opts.lr, foreach=opts.foreach))
    return Contender(name, model, optimizer, dtype, "mfsdp", ctx=ctx, shard_size=shard_size, engine=engine)


def build_fsdp2(name: str, ref: nn.Module, dtype: torch.dtype, mesh, opts: Options) -> Contender:
    from torch.distributed.fsdp import MixedPrecisionPolicy as Fsdp2Policy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    model = copy.deepcopy(ref)
    policy = Fsdp2Policy() if dtype == torch.float32 else Fsdp2Policy(param_dtype=dtype, reduce_dtype=dtype)
    layers = list(model.decoder.layers)
    for layer in layers:
        fsdp2_fully_shard(layer, mesh=mesh, mp_policy=policy)
    fsdp2_fully_shard(model, mesh=mesh, mp_policy=policy)
    if opts.fsdp2_forward_prefetch:
        for i, layer in enumerate(layers[:-1]):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, foreach=opts.foreach)
    return Contender(name, model, optimizer, dtype, "fsdp2", shard_size=world())


def build_ddp(name: str, ref: nn.Module, dtype: torch.dtype, opts: Options) -> Contender:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(copy.deepcopy(ref), gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, foreach=opts.foreach)
    return Contender(name, model, optimizer, dtype, "ddp", autocast=dtype != torch.float32, shard_size=1)


def build_plain(ref: nn.Module, dtype: torch.dtype, opts: Options) -> Contender:
    """No wrapper, no communication: each rank trains its own copy (compute-only time)."""
    model = copy.deepcopy(ref)
    if dtype != torch.float32:
        model = model.to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, foreach=opts.foreach)
    return Contender("plain", model, optimizer, dtype, "plain")


def base_name(name: str) -> str:
    """The contender without its prototypes (``+name``) or engine revision (``@rev``)."""
    return name.split("+", 1)[0].split("@", 1)[0]


def build(name: str, ref: nn.Module, dtype: torch.dtype, meshes: Meshes, opts: Options, engine=mfsdp_v2) -> Contender:
    if "@" in name.split("+", 1)[0]:  # an MFSDP contender on the engine of an older revision
        import engine_snapshot

        head, _, rest = name.partition("@")
        rev, plus, protos = rest.partition("+")
        c = build(head + plus + protos, ref, dtype, meshes, opts, engine=engine_snapshot.load(rev))
        if c.kind != "mfsdp":
            raise ValueError(f"an engine revision applies to MFSDP contenders only, not {head!r}")
        c.name = name
        return c
    if "+" in name:  # an MFSDP contender with benchmark-only prototypes (prototypes.py)
        import prototypes

        base, *protos = name.split("+")
        c = build(base, ref, dtype, meshes, opts, engine)
        if c.kind != "mfsdp":
            raise ValueError(f"prototypes apply to MFSDP contenders only, not {base!r}")
        prototypes.apply_to_context(c.ctx, protos)
        c.name = name
        return c
    if name == "mfsdp_zero3":
        return build_mfsdp(name, ref, dtype, lambda P: P.zero3(), meshes.flat, opts, world(), engine)
    if name == "mfsdp_zero2":
        return build_mfsdp(name, ref, dtype, lambda P: P.zero2(), meshes.flat, opts, world(), engine)
    if name == "mfsdp_hsdp":
        if meshes.hsdp is None:
            raise ValueError("mfsdp_hsdp needs an even world size of at least 4 (a 2 x N/2 mesh).")
        return build_mfsdp(name, ref, dtype, lambda P: P.hsdp("outer", "inner"), meshes.hsdp, opts, 2, engine)
    if name == "fsdp2":
        return build_fsdp2(name, ref, dtype, meshes.flat, opts)
    if name == "ddp":
        return build_ddp(name, ref, dtype, opts)
    if name == "mfsdp_no_shard":
        return build_mfsdp(name, ref, dtype, lambda P: P.no_shard(), meshes.flat, opts, 1, engine)
    raise ValueError(f"unknown contender {name!r}; choose from {ALL_CONTENDERS}")


def default_contenders(n: int) -> List[str]:
    names = ["mfsdp_zero3", "mfsdp_zero2"]
    if n >= 4 and n % 2 == 0:
        names.append("mfsdp_hsdp")
    return names + ["fsdp2", "ddp"]


# --------------------------------------------------------------------------------------
# Counting bytes per collective kind (one untimed step)
# --------------------------------------------------------------------------------------

_COUNTED_FUNCTIONS = {
    # name in torch.distributed -> (kind, which argument holds what this rank contributes)
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
}


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else world()


def wire_bytes(kind: str, input_bytes: int, size: int) -> float:
    """Bytes one rank sends for a collective under the bandwidth-optimal (ring) algorithm.

    all_gather: contributes ``input_bytes`` (its shard), sends (N-1) shards.
    reduce_scatter: contributes ``input_bytes`` (the full buffer), sends (N-1)/N of it.
    all_reduce: reduce-scatter + all-gather of the buffer, 2 (N-1)/N of it."""
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


def count_collectives(c: Contender, batch, ref: nn.Module, meshes: Meshes, opts: Options) -> dict:
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


# --------------------------------------------------------------------------------------
# MFSDP hook overhead
# --------------------------------------------------------------------------------------


class HookTimer:
    """Wall time inside MFSDP's hooks (outermost calls only) and, within it, the time the
    host blocks waiting for a collective. hook - wait = the engine's own work on the
    training thread (Python, launching collectives, its copies/allocations/casts)."""

    def __init__(self):
        self.hook_time = 0.0
        self.wait_time = 0.0
        self.wait_outside = 0.0
        # CPU time of the training thread inside the hooks (time.thread_time): excludes the
        # time the thread is descheduled (4 ranks share 2 cores) and blocked in waits.
        self.hook_cpu = 0.0
        self.wait_cpu = 0.0
        self.calls = 0
        self._depth = 0
        self._undo: List[Callable] = []

    def _timed(self, fn, is_wait=False):
        timer = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if is_wait:
                if timer._depth == 0:  # e.g. the optimizer wrapper waiting for ZeRO-2's all-gather
                    t = time.perf_counter()
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        timer.wait_outside += time.perf_counter() - t
                t, c = time.perf_counter(), time.thread_time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    timer.wait_time += time.perf_counter() - t
                    timer.wait_cpu += time.thread_time() - c
            timer._depth += 1
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                timer._depth -= 1
                if timer._depth == 0:
                    timer.hook_time += time.perf_counter() - t
                    timer.hook_cpu += time.thread_time() - c
                    timer.calls += 1

        return wrapper

    def _patch_attr(self, owner, name, is_wait=False):
        original = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
        setattr(owner, name, self._timed(original, is_wait))
        self._undo.append(lambda: setattr(owner, name, original))

    def install(self, contender: Contender):
        from engine_snapshot import submodule

        ctx_mod, module_mod, pg_mod, work_mod = (
            submodule(contender.engine, name) for name in ("context", "module", "parameter_group", "work")
        )

        # Hooks looked up at call time: patch the classes.
        self._patch_attr(module_mod.UnitState, "_pre_backward")
        self._patch_attr(ctx_mod.FsdpContext, "_on_grad_ready")
        if hasattr(pg_mod.ParameterGroup, "_stash_grad"):
            # Gradient hooks move each gradient into the reduce buffer before _on_grad_ready.
            self._patch_attr(pg_mod.ParameterGroup, "_stash_grad")
        self._patch_attr(ctx_mod.FsdpContext, "_finish_backward")
        self._patch_attr(pg_mod.ParameterGroup, "sync_model_weight")
        self._patch_attr(work_mod.CollectiveWork, "_complete_on_host", is_wait=True)
        # Forward hooks were bound at registration: swap the stored callables.
        for unit in contender.ctx.units:
            for hooks in (unit._forward_pre_hooks, unit._forward_hooks):
                for key, hook in list(hooks.items()):
                    if getattr(hook, "__self__", None) is unit._fsdp_state:
                        hooks[key] = self._timed(hook)
                        self._undo.append(functools.partial(hooks.__setitem__, key, hook))
        return self

    def uninstall(self):
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


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


# --------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------


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
        for group in unit._fsdp_state.groups:
            layout = group.layout
            total_numel += layout.total_numel
            slack_numel += layout.shard_numel - layout.total_numel / layout.num_shards
            bound_numel += max(layout.row_numels) if layout.row_numels else 0
    return {"unsharded_numel": total_numel, "shards": c.shard_size,
            "padding_numel_per_rank": slack_numel, "one_row_per_group_numel": bound_numel,
            "within_bound": slack_numel < bound_numel}


def hook_overhead(c: Contender, batch, steps: int) -> dict:
    timer = HookTimer().install(c)
    t = time.perf_counter()
    for _ in range(steps):
        c.step(*batch)
    wall = time.perf_counter() - t
    timer.uninstall()
    units = len(c.ctx.units)
    own = (timer.hook_time - timer.wait_time) / steps
    return {
        "steps": steps, "units": units, "step_wall_s": wall / steps,
        "hook_s_per_step": timer.hook_time / steps, "wait_s_per_step": timer.wait_time / steps,
        "wait_outside_hooks_s_per_step": timer.wait_outside / steps,
        "own_s_per_step": own, "own_s_per_unit_per_step": own / units,
        # CPU time of the training thread in the hooks, the post-ops run inside waits included
        # (division, accumulation, copy-out of shard-spanning tensors are engine work too).
        "own_cpu_s_per_step": timer.hook_cpu / steps, "own_cpu_s_per_unit_per_step": timer.hook_cpu / steps / units,
        "wait_cpu_s_per_step": timer.wait_cpu / steps,
        "hook_calls_per_step": timer.calls / steps,
    }


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
        results[c.name]["collectives"] = count_collectives(c, batches[rounds], ref, meshes, opts)
    if "mfsdp_no_shard" not in names and not args.no_count_no_shard:
        # Bytes only (the issue's no_shard = 2x target): one counted step, then dropped.
        probe = build_mfsdp("mfsdp_no_shard", ref, dtype, lambda P: P.no_shard(), meshes.flat, opts, 1)
        dist.barrier()
        results["mfsdp_no_shard"] = {
            "collectives": count_collectives(probe, batches[rounds], ref, meshes, opts),
            "expected": expected_bytes(spec, dtype, "mfsdp_no_shard", n),
            "bytes_only": True,
        }
        del probe
    hook_steps = max(1, min(3, args.steps))
    for c in contenders:
        dist.barrier()
        if c.kind == "mfsdp":
            results[c.name]["hooks"] = hook_overhead(c, batches[rounds + 1], hook_steps)
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


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


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
        for g in unit._fsdp_state.groups:
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


# --------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------


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


def resolve_spec(args, dtype: str) -> ModelSpec:
    base = dict(SMOKE_CONFIG if args.smoke else DEFAULT_CONFIGS[dtype])
    for key in base:
        value = getattr(args, key)
        if value is not None:
            base[key] = value
    return ModelSpec(**base)


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
