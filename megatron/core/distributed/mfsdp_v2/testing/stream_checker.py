"""Test-only: check the engine's CUDA stream protocol on CPU, without a GPU.

``StreamChecker`` is a ``TorchDispatchMode`` that runs while the engine trains under
``device.SimulatedStreamsHandle`` (it installs that handle for every ``fully_shard_context``
opened inside it). It applies the idea of PyTorch's CUDA sanitizer to our own protocol:

* Every dispatched op is one operation on the *current simulated stream* (the engine's
  ``device.stream(...)`` contexts). It reads the tensors it only takes as input, writes
  the ones its schema marks as mutated and the fresh tensors it returns. A collective
  (``c10d`` op) reads its input and writes its output on the stream it was issued on; the
  engine's ``CollectiveWork`` completes it on that same stream (its stream-ordered path).
* Per tensor *storage* the checker keeps the last write and the reads since, each with its
  stream and sequence number, and reports:

  - ``read-after-write``: a read on stream B of data written on stream A, where the write
    does not happen before (no event/stream wait carried A's clock to B);
  - ``write-after-read`` / ``write-after-write``: a write racing a pending read or write;
  - ``reuse-after-free``: the CUDA caching allocator's rule. Memory freed on the host
    (``storage.resize_(0)`` or the last reference dropped) returns to the pool of the
    stream it was allocated on and may back the next allocation on that stream at once.
    Uses of the freed storage on other streams are pending hazards of that pool unless
    ``keep_alive_for`` (``record_stream``) covered them; the first write to a later
    allocation from the pool must happen after every such hazard.

Each report names the op, the streams, both accesses' short stacks and where the storage
was allocated. Happens-before is a vector clock per stream (``SimulatedStream.clock``);
``wait_event`` / ``wait_stream`` join clocks, ``synchronize`` and host reads (``.item()``)
join the host into every stream.

Use::

    with StreamChecker() as checker:
        model, ctx = build_and_wrap()        # the contexts get the simulated handle
        train(model)
    checker.assert_clean()
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor

from megatron.core.torch_private import TorchDispatchMode, dtensor_local, tree_leaves

from ..device import handles_from
from .simulated_streams import SimulatedStream, SimulatedStreamsHandle

# Ops whose tensor inputs are metadata only (shape, dtype), as in the CUDA sanitizer.
_FACTORY = re.compile(r"^(new_.*|.*_like)$")
# Ops that only allocate: their output has no defined content, so it is not a write.
_ALLOCATION_ONLY = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
# Ops whose result the host reads (a device-to-host copy that synchronizes the stream).
_HOST_READS = {"_local_scalar_dense", "equal", "is_nonzero"}
_SKIP_FRAMES = (
    os.sep + "torch" + os.sep, os.path.abspath(__file__), os.sep + "contextlib.py", os.sep + "_pytest" + os.sep,
    os.sep + "pluggy" + os.sep,
)
STACK_DEPTH = 4


def _short_stack() -> Tuple[str, ...]:
    """The innermost frames outside torch, pytest and this module: ``file:line function``."""
    frames, frame = [], sys._getframe(1)
    while frame is not None and len(frames) < STACK_DEPTH:
        filename = frame.f_code.co_filename
        if not any(part in filename for part in _SKIP_FRAMES):
            short = os.sep.join(filename.split(os.sep)[-2:])
            frames.append(f"{short}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return tuple(frames)


@dataclasses.dataclass(frozen=True)
class Access:
    kind: str  # "read" or "write"
    stream_id: int
    stream: str
    seq: int
    op: str
    stack: Tuple[str, ...]

    def describe(self) -> str:
        return f"{self.kind} by {self.op} on stream '{self.stream}' (#{self.seq})"


@dataclasses.dataclass
class Report:
    kind: str  # read-after-write, write-after-read, write-after-write, reuse-after-free
    access: Access
    other: Access
    storage: str  # what the storage holds and where it was allocated
    note: str = ""
    count: int = 1

    def __str__(self) -> str:
        lines = [
            f"[{self.kind}] {self.access.describe()} of {self.storage}",
            f"    is not ordered after the {self.other.describe()}{self.note}",
            "    this access at: " + " <- ".join(self.access.stack),
            "    other access at: " + " <- ".join(self.other.stack),
        ]
        if self.count > 1:
            lines.append(f"    (seen {self.count} times)")
        return "\n".join(lines)


@dataclasses.dataclass
class _Hazard:
    access: Access
    freed_at: Tuple[str, ...]


@dataclasses.dataclass
class _StorageState:
    pool: int  # the stream whose allocator pool the memory came from
    description: str
    last_write: Optional[Access] = None
    reads: Dict[int, Access] = dataclasses.field(default_factory=dict)  # latest read per stream
    recorded: set = dataclasses.field(default_factory=set)  # streams covered by record_stream
    inherited: Dict[int, _Hazard] = dataclasses.field(default_factory=dict)  # pool hazards at allocation


class StreamChecker(TorchDispatchMode):
    """Tracks reads and writes per storage on simulated streams and reports races (see module doc)."""

    def __init__(self, max_reports: int = 50):
        super().__init__()
        self.handle = SimulatedStreamsHandle(observer=self)
        self.reports: List[Report] = []
        self.max_reports = max_reports
        self._states: Dict[int, _StorageState] = {}
        self._refs: Dict[int, weakref.ref] = {}
        self._pool_hazards: Dict[int, Dict[int, _Hazard]] = {}
        self._report_keys: Dict[tuple, Report] = {}
        self._lock = threading.RLock()
        self._exits = []

    # Activation -------------------------------------------------------------------------
    def __enter__(self):
        handles = handles_from(lambda device: self.handle)
        handles.__enter__()
        self._exits.append(handles.__exit__)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            while self._exits:
                self._exits.pop()(None, None, None)

    # Results ----------------------------------------------------------------------------
    def format_reports(self) -> str:
        return "\n".join(str(r) for r in self.reports)

    def assert_clean(self) -> None:
        if self.reports:
            raise AssertionError(f"{len(self.reports)} stream-protocol report(s):\n{self.format_reports()}")

    def kinds(self) -> set:
        return {r.kind for r in self.reports}

    # Observer of the simulated handle ----------------------------------------------------
    def record_stream(self, tensor: torch.Tensor, stream: SimulatedStream) -> None:
        with self._lock:
            key = self._key(tensor)
            if key is not None and key in self._states:
                self._states[key].recorded.add(stream.id)

    # Dispatch ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads, writes = self._inputs(func, args, kwargs)
        out = func(*args, **kwargs)
        fresh = self._fresh_outputs(func, out)
        stream = self.handle.current_stream()
        with self._lock:
            self._on_op(func, stream, reads, writes, fresh)
        if func._schema.name.split("::")[-1] in _HOST_READS:
            self.handle._host_waits(stream.clock)
        return out

    @staticmethod
    def _tensors(value):
        for leaf in tree_leaves(value):
            if isinstance(leaf, DTensor):
                leaf = dtensor_local(leaf)
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                yield leaf

    def _inputs(self, func, args, kwargs):
        schema = func._schema
        bound = list(zip(schema.arguments, args)) + [
            (a, kwargs[a.name]) for a in schema.arguments[len(args):] if a.name in kwargs
        ]
        reads, writes = [], []
        if func.namespace == "c10d":
            # c10d schemas carry no alias annotations: outputs are named so, inputs too,
            # and in-place collectives take ``tensors`` (which a send only reads and a
            # receive only writes).
            op = schema.name.split("::")[-1]
            for argument, value in bound:
                name = argument.name
                if "output" in name or (name == "tensors" and op != "send"):
                    writes.extend(self._tensors(value))
                if "input" in name or (name == "tensors" and not op.startswith("recv")):
                    reads.extend(self._tensors(value))
            return reads, writes
        factory = bool(_FACTORY.match(schema.name.split("::")[-1]))
        for argument, value in bound:
            alias = argument.alias_info
            if alias is not None and alias.is_write:
                writes.extend(self._tensors(value))
            elif alias is None and not factory:
                reads.extend(self._tensors(value))
        return reads, writes

    def _fresh_outputs(self, func, out):
        """Tensors the op returns in new memory (not views, not its in-place arguments)."""
        schema = func._schema
        if func.namespace == "c10d":
            return []
        values = out if len(schema.returns) > 1 else (out,)
        fresh = []
        for ret, value in zip(schema.returns, values):
            if ret.alias_info is None:
                fresh.extend(self._tensors(value))
        return fresh

    @staticmethod
    def _key(tensor: torch.Tensor) -> Optional[int]:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        return id(storage) if storage.nbytes() > 0 else None

    def _state(self, tensor: torch.Tensor, stream: SimulatedStream, new: bool) -> Optional[Tuple[int, _StorageState]]:
        key = self._key(tensor)
        if key is None:
            return None
        state = self._states.get(key)
        if state is None:
            storage = tensor.untyped_storage()
            # Unknown memory seen as an input existed before the checker: the default pool.
            pool = stream.id if new else self.handle.default_stream.id
            dtype = str(tensor.dtype).replace("torch.", "")
            state = self._new_state(pool, f"the storage of a {tuple(tensor.shape)} {dtype} tensor allocated")
            self._states[key] = state
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._storage_died(key))
        return key, state

    def _new_state(self, pool: int, what: str) -> _StorageState:
        site = " <- ".join(_short_stack()[:2]) or "?"
        return _StorageState(pool, f"{what} at {site}", inherited=dict(self._pool_hazards.get(pool, {})))

    def _on_op(self, func, stream: SimulatedStream, reads, writes, fresh) -> None:
        op = str(func)
        seq = stream.tick()
        stack = _short_stack()
        written = {}
        for tensor in writes:
            found = self._state(tensor, stream, new=False)
            if found:
                written[found[0]] = found[1]
        for tensor in fresh:
            found = self._state(tensor, stream, new=True)
            if found and func._schema.name.split("::")[-1] not in _ALLOCATION_ONLY:
                written[found[0]] = found[1]
        for tensor in reads:
            found = self._state(tensor, stream, new=False)
            if found is None or found[0] in written:
                continue
            state = found[1]
            access = Access("read", stream.id, stream.name, seq, op, stack)
            last = state.last_write
            if last is not None and not stream.ordered_after(last.stream_id, last.seq):
                self._report("read-after-write", access, last, state)
            state.reads[stream.id] = access
        for state in written.values():
            access = Access("write", stream.id, stream.name, seq, op, stack)
            for read in state.reads.values():
                if not stream.ordered_after(read.stream_id, read.seq):
                    self._report("write-after-read", access, read, state)
            last = state.last_write
            if last is not None and not stream.ordered_after(last.stream_id, last.seq):
                self._report("write-after-write", access, last, state)
            for hazard in state.inherited.values():
                if not stream.ordered_after(hazard.access.stream_id, hazard.access.seq):
                    self._report("reuse-after-free", access, hazard.access, state,
                                 note=f"\n    on memory freed at {' <- '.join(hazard.freed_at) or '?'} without "
                                      "record_stream (keep_alive_for) or a wait of its pool's stream")
            state.inherited = {}
            state.last_write = access
            state.reads = {}

    def _report(self, kind: str, access: Access, other: Access, state: _StorageState, note: str = "") -> None:
        key = (kind, access.op, access.stack[:1], other.op, other.stack[:1])
        if key in self._report_keys:
            self._report_keys[key].count += 1
            return
        if len(self.reports) >= self.max_reports:
            return
        report = Report(kind, access, other, state.description, note)
        self._report_keys[key] = report
        self.reports.append(report)

    # Frees --------------------------------------------------------------------------------
    def _free(self, state: _StorageState) -> None:
        """The memory goes back to its pool: unprotected uses become the pool's hazards."""
        hazards = self._pool_hazards.setdefault(state.pool, {})
        uses = ([state.last_write] if state.last_write is not None else []) + list(state.reads.values())
        # The stack of the free only matters (and is only paid for) when another stream used it.
        freed_at = _short_stack() if any(u.stream_id != state.pool for u in uses) else ()
        for use in uses:
            if use.stream_id in state.recorded:
                continue  # record_stream: the allocator waits for this stream itself
            previous = hazards.get(use.stream_id)
            if previous is None or previous.access.seq < use.seq:
                hazards[use.stream_id] = _Hazard(use, freed_at)

    def _storage_died(self, key: int) -> None:
        with self._lock:
            self._refs.pop(key, None)
            state = self._states.pop(key, None)
            if state is not None:
                self._free(state)

    def storage_resized(self, storage, before: int, size: int) -> None:
        """The engine resized a storage through the handle (frees and reallocations)."""
        with self._lock:
            key = id(storage)
            state = self._states.get(key)
            if state is not None and before > 0:
                self._free(state)
                del self._states[key]
            if size > 0:
                stream = self.handle.current_stream()
                self._states[key] = self._new_state(stream.id, f"a storage of {size} bytes allocated by resize_")
                if key not in self._refs:
                    self._refs[key] = weakref.ref(storage, lambda _, key=key: self._storage_died(key))
