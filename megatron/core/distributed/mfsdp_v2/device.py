"""One device handle for CUDA and CPU, so the engine has a single code path.

On CUDA the handle hands out real streams and events. On CPU it hands out stand-ins with
the same interface: gloo collectives launched with ``async_op=True`` already run on gloo's
own threads, so the host-side ``wait()`` of the work object is the only dependency that
matters, and stream waits/records are no-ops there.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch


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


class DeviceHandle:
    """Streams, events, NVTX ranges and memory bookkeeping for one device."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cuda", "cpu"):
            raise NotImplementedError(
                f"MFSDP v2 runs on 'cuda' or 'cpu' devices, got {self.device}; "
                "pass device=torch.device('cuda') or torch.device('cpu') to fully_shard_context."
            )
        self.is_cuda = self.device.type == "cuda"
        self._default_host_stream = HostStream("default")

    # Streams and events -------------------------------------------------------------
    def new_stream(self, name: str):
        if self.is_cuda:
            return torch.cuda.Stream(device=self.device)
        return HostStream(name)

    def current_stream(self):
        if self.is_cuda:
            return torch.cuda.current_stream(self.device)
        return self._default_host_stream

    def stream(self, stream):
        """Context manager making ``stream`` current (a no-op on CPU)."""
        if self.is_cuda:
            return torch.cuda.stream(stream)
        return contextlib.nullcontext()

    def record_event(self, stream=None):
        stream = stream if stream is not None else self.current_stream()
        if self.is_cuda:
            return stream.record_event()
        return HostEvent()

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def nvtx_range(self, name: str):
        if self.is_cuda:
            return torch.cuda.nvtx.range(name)
        return contextlib.nullcontext()

    # Memory ----------------------------------------------------------------------------
    def keep_alive_for(self, tensor: torch.Tensor, stream) -> None:
        """Tell the caching allocator ``tensor`` is used on ``stream`` (CUDA only;
        ``record_stream`` is not implemented for CPU tensors and not needed there)."""
        if self.is_cuda and stream is not None:
            tensor.record_stream(stream)


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
