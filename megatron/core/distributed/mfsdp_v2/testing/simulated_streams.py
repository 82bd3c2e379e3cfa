"""Simulated streams: CPU tensors, but streams and events with vector clocks.

``SimulatedStreamsHandle`` is stream-ordered, so the engine runs exactly its CUDA code path
on it, and ``stream_checker.StreamChecker`` reads its clocks to find missing waits without
a GPU. Test machinery: the engine never imports it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterator, Optional

import torch

from ..device import DeviceHandle


VectorClock = Dict[int, int]  # stream id -> the last operation of that stream ordered before


def _join(into: VectorClock, other: VectorClock) -> None:
    for stream_id, seq in other.items():
        if into.get(stream_id, 0) < seq:
            into[stream_id] = seq


class SimulatedEvent:
    """An event: the clock of its stream when it was recorded."""

    def __init__(self, domain: "SimulatedStreamsHandle", clock: VectorClock):
        self._domain = domain
        self.clock = dict(clock)

    def wait(self, stream=None) -> None:
        (stream if stream is not None else self._domain.current_stream()).wait_event(self)

    def synchronize(self) -> None:
        self._domain._host_waits(self.clock)

    def query(self) -> bool:
        return True


class SimulatedStream:
    """A stream with a vector clock. Every operation issued on it ticks its own entry;
    ``wait_event``/``wait_stream`` join another clock into it (a happens-before edge)."""

    def __init__(self, domain: "SimulatedStreamsHandle", stream_id: int, name: str):
        self._domain = domain
        self.id = stream_id
        self.name = name
        self.clock: VectorClock = dict(domain.host_clock)
        self.clock[stream_id] = 0

    def tick(self) -> int:
        """A new operation on this stream; returns its sequence number."""
        self.clock[self.id] += 1
        return self.clock[self.id]

    def ordered_after(self, stream_id: int, seq: int) -> bool:
        """Whether operation ``seq`` of stream ``stream_id`` happens before this stream's next one."""
        return stream_id == self.id or self.clock.get(stream_id, 0) >= seq

    def wait_stream(self, other: "SimulatedStream") -> None:
        _join(self.clock, other.clock)

    def wait_event(self, event: SimulatedEvent) -> None:
        _join(self.clock, event.clock)

    def record_event(self, event: Optional[SimulatedEvent] = None) -> SimulatedEvent:
        if event is None:
            return SimulatedEvent(self._domain, self.clock)
        event.clock = dict(self.clock)
        return event

    def synchronize(self) -> None:
        self._domain._host_waits(self.clock)

    def __repr__(self) -> str:
        return f"SimulatedStream({self.name})"


class SimulatedStreamsHandle(DeviceHandle):
    """Test-only: CPU tensors, CUDA semantics for streams and events.

    It takes the engine's CUDA code path (``stream_ordered``). The data stays correct on
    CPU because the CUDA path's stream wait on a collective (``work.wait()`` on the
    collective's stream) blocks the host on gloo, right where NCCL would order the stream;
    the *ordering* CUDA would give is kept in the clocks, which is what the checker judges.
    One handle is one device: every context built under one ``StreamChecker`` shares it, so
    they share the default stream as CUDA contexts would.

    ``observer`` (the checker) hears of ``keep_alive_for`` (``record_stream``) and of the
    engine's storage resizes (``resize_storage``)."""

    stream_ordered = True

    def __init__(self, device: torch.device = torch.device("cpu"), observer=None):
        super().__init__(device)
        self.observer = observer
        self.host_clock: VectorClock = {}
        self.streams = []
        self._local = threading.local()
        self.default_stream = self.new_stream("default")

    def new_stream(self, name: str) -> SimulatedStream:
        stream = SimulatedStream(self, len(self.streams), name)
        self.streams.append(stream)
        self.host_clock[stream.id] = 0
        return stream

    def current_stream(self) -> SimulatedStream:
        return getattr(self._local, "stream", None) or self.default_stream

    @contextlib.contextmanager
    def stream(self, stream: SimulatedStream) -> Iterator[SimulatedStream]:
        if not isinstance(stream, SimulatedStream) or stream._domain is not self:
            raise ValueError(f"{stream!r} is not a stream of this simulated device; use its new_stream().")
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = previous

    def synchronize(self) -> None:
        for stream in self.streams:
            self._host_waits(stream.clock)

    def _host_waits(self, clock: VectorClock) -> None:
        """The host blocked until ``clock``: everything issued from now on, on any stream,
        is ordered after it."""
        _join(self.host_clock, clock)
        for stream in self.streams:
            _join(stream.clock, self.host_clock)

    def resize_storage(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        before = storage.nbytes()
        storage.resize_(nbytes)
        if self.observer is not None:
            self.observer.storage_resized(storage, before, int(nbytes))

    def keep_alive_for(self, tensor: torch.Tensor, stream) -> None:
        if self.observer is not None and stream is not None:
            self.observer.record_stream(tensor, stream)
