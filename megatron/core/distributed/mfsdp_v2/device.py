"""Device handles: every stream, event and memory-lifetime call of the engine goes here.

The engine holds one handle per context (``FsdpContext.device_handle``) and has no
device-specific branch of its own: where CUDA and CPU differ, the handle answers.

* ``CudaDeviceHandle``: real streams and events. Collectives are *stream-ordered*
  (``stream_ordered`` is True): a consumer's stream waits on an event, the host never
  blocks.
* ``CpuDeviceHandle``: stand-ins with the CUDA interface. gloo collectives launched with
  ``async_op=True`` run on gloo's threads, so the host-side ``wait()`` of the work object is
  the only dependency that matters; stream waits and records are no-ops.

``device_handle_for(device)`` picks the handle; ``handles_from(factory)`` substitutes
another for every context opened inside it (the ``testing`` subpackage's simulated
streams, a device the engine does not know).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, Optional

import torch


class DeviceHandle:
    """Streams, events, NVTX ranges and memory bookkeeping for one device (the interface)."""

    #: True when a collective's result is ordered on streams (the consumer's stream waits on
    #: an event, the host does not block); False when only the host-side wait orders it.
    stream_ordered: bool = False

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        # Wraps every profiler range of this handle's context when set (profiling.py):
        # ``observer(name, inner) -> context manager``. The benchmarks measure with it.
        self.range_observer = None

    def new_stream(self, name: str):
        raise NotImplementedError

    def resize_storage(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give a storage ``nbytes`` bytes (0 frees it): the engine's only (de)allocation of
        the unsharded weights, so a handle can watch it (the testing package's does)."""
        storage.resize_(nbytes)

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
# Choosing a handle
# --------------------------------------------------------------------------------------

_HANDLE_FACTORY: contextvars.ContextVar[Optional[Callable[[torch.device], DeviceHandle]]] = (
    contextvars.ContextVar("mfsdp_v2_device_handle_factory", default=None)
)


def device_handle_for(device: torch.device) -> DeviceHandle:
    """The handle a context on ``device`` uses (``handles_from``'s, while one is set)."""
    device = torch.device(device)
    factory = _HANDLE_FACTORY.get()
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
    """Every ``fully_shard_context`` opened inside gets ``factory(device)`` as its device
    handle (``testing.StreamChecker`` installs simulated streams with it)."""
    token = _HANDLE_FACTORY.set(factory)
    try:
        yield
    finally:
        _HANDLE_FACTORY.reset(token)


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
