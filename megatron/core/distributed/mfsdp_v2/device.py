"""Device handles: every stream, event and memory-lifetime call of the engine goes here.

The engine holds one handle per context (``FsdpContext.device_handle``) and has no
device-specific branch of its own: where CUDA and CPU differ, the handle answers.

* ``CudaDeviceHandle``: real streams and events. Collectives are *stream-ordered*
  (``stream_ordered`` is True): a consumer's stream waits on an event, the host never
  blocks.
* ``CpuDeviceHandle``: stand-ins with the CUDA interface. gloo collectives launched with
  ``async_op=True`` run on gloo's threads, so the host-side ``wait()`` of the work object is
  the only dependency that matters; stream waits and records are no-ops.
* ``SimulatedStreamsHandle`` (test-only): CPU tensors, but streams and events with vector
  clocks. It is stream-ordered, so the engine runs exactly its CUDA code path, and
  ``stream_checker.StreamChecker`` reads its clocks to find missing waits without a GPU.

``device_handle_for(device)`` picks the handle; tests replace the choice with
``handles_from(factory)`` (production code never does).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Callable, Dict, Iterator, Optional

import torch


class DeviceHandle:
    """Streams, events, NVTX ranges and memory bookkeeping for one device (the interface)."""

    #: True when a collective's result is ordered on streams (the consumer's stream waits on
    #: an event, the host does not block); False when only the host-side wait orders it.
    stream_ordered: bool = False

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def new_stream(self, name: str):
        raise NotImplementedError

    def current_stream(self):
        raise NotImplementedError

    def stream(self, stream):
        """Context manager making ``stream`` current."""
        raise NotImplementedError

    def record_event(self, stream=None):
        stream = stream if stream is not None else self.current_stream()
        return stream.record_event()

    def stream_waits_for_current(self, stream) -> None:
        """Order ``stream`` after everything already queued on the current stream."""
        current = self.current_stream()
        if stream != current:
            stream.wait_stream(current)

    def current_waits_for(self, stream) -> None:
        """Order the current stream after everything already queued on ``stream``."""
        current = self.current_stream()
        if stream != current:
            current.wait_stream(stream)

    def synchronize(self) -> None:
        pass

    def nvtx_range(self, name: str):
        return contextlib.nullcontext()

    def keep_alive_for(self, tensor: torch.Tensor, stream) -> None:
        """Tell the allocator ``tensor`` is used on ``stream`` (``record_stream``): its memory
        is not reused before ``stream`` reaches the point of the free."""


class CudaDeviceHandle(DeviceHandle):
    stream_ordered = True

    def __init__(self, device: torch.device):
        super().__init__(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def new_stream(self, name: str):
        return torch.cuda.Stream(device=self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def nvtx_range(self, name: str):
        return torch.cuda.nvtx.range(name)

    def keep_alive_for(self, tensor: torch.Tensor, stream) -> None:
        if stream is not None:
            tensor.record_stream(stream)


class HostEvent:
    """CPU stand-in for ``torch.cuda.Event``: everything on the host is already ordered."""

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class HostStream:
    """CPU stand-in for ``torch.cuda.Stream`` (``torch.cpu.Stream`` cannot record events)."""

    def __init__(self, name: str):
        self.name = name

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> HostEvent:
        return event if event is not None else HostEvent()

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"HostStream({self.name})"


class CpuDeviceHandle(DeviceHandle):
    stream_ordered = False

    def __init__(self, device: torch.device):
        super().__init__(device)
        self._default_stream = HostStream("default")

    def new_stream(self, name: str):
        return HostStream(name)

    def current_stream(self):
        return self._default_stream

    def stream(self, stream):
        return contextlib.nullcontext()  # ``record_stream`` is not implemented on CPU, nor needed


# --------------------------------------------------------------------------------------
# Simulated streams (test-only)
# --------------------------------------------------------------------------------------

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

    ``observer`` (the checker) hears of ``keep_alive_for`` (``record_stream``)."""

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

    def keep_alive_for(self, tensor: torch.Tensor, stream) -> None:
        if self.observer is not None and stream is not None:
            self.observer.record_stream(tensor, stream)


# --------------------------------------------------------------------------------------
# Choosing a handle
# --------------------------------------------------------------------------------------

_TEST_HANDLE_FACTORY: contextvars.ContextVar[Optional[Callable[[torch.device], DeviceHandle]]] = (
    contextvars.ContextVar("mfsdp_v2_test_device_handle_factory", default=None)
)


def device_handle_for(device: torch.device) -> DeviceHandle:
    """The handle a context on ``device`` uses (the test factory's, while one is set)."""
    device = torch.device(device)
    factory = _TEST_HANDLE_FACTORY.get()
    if factory is not None:
        return factory(device)
    if device.type == "cuda":
        return CudaDeviceHandle(device)
    if device.type == "cpu":
        return CpuDeviceHandle(device)
    raise NotImplementedError(
        f"MFSDP v2 runs on 'cuda' or 'cpu' devices, got {device}; "
        "pass device=torch.device('cuda') or torch.device('cpu') to fully_shard_context."
    )


@contextlib.contextmanager
def handles_from(factory: Callable[[torch.device], DeviceHandle]) -> Iterator[None]:
    """Test-only: every ``fully_shard_context`` opened inside gets ``factory(device)`` as
    its device handle (``StreamChecker`` uses this to install simulated streams)."""
    token = _TEST_HANDLE_FACTORY.set(factory)
    try:
        yield
    finally:
        _TEST_HANDLE_FACTORY.reset(token)


def default_device() -> torch.device:
    """The current accelerator device, or CPU when there is none."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_device(device: Optional[torch.device | str | int]) -> torch.device:
    if device is None:
        return default_device()
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)
