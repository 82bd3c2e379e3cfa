"""Profiler ranges around the engine's hooks, visible on CPU and CUDA alike.

While a torch profiler records, every hook body runs inside a
``torch.profiler.record_function`` range (seen on any device); on CUDA it also runs inside
an NVTX range of the same name (seen by Nsight Systems). Names
follow upstream MFSDP v2's NVTX labels: ``MFSDP <unit name> <hook>``, the root shown as
``<root>``. Each range is a ``with`` block, so it is balanced even when a hook raises.

A context's device handle may carry a ``range_observer`` (``observer(name, inner)``
returns the context manager that wraps ``inner``): the benchmarks set one on the context
they measure to add up the engine's own CPU time per range (benchmarks/cpu_time_ledger.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from megatron.core.torch_private import profiler_enabled


def unit_label(name: Optional[str]) -> str:
    """How a unit appears in range names: its module path, or ``<root>``."""
    return "<root>" if not name else name


def hook_range(name: str, device_handle):
    """The range around one hook body. Without an active torch profiler only the NVTX
    range is opened (nothing at all on CPU): a record_function costs tens of microseconds
    per hook even when nobody records."""
    if profiler_enabled():
        inner = _profiled_range(name, device_handle)
    else:
        inner = device_handle.nvtx_range(name)
    return _observed(name, inner, device_handle)


def cpu_range(name: str, device_handle):
    """A CPU-only range (e.g. the host blocked on a collective), recorded only while a
    torch profiler runs: nested in a hook's range, it splits the hook's time into waiting
    and the engine's own work."""
    inner = torch.profiler.record_function(name) if profiler_enabled() else contextlib.nullcontext()
    return _observed(name, inner, device_handle)


def _observed(name: str, inner, device_handle):
    observer = device_handle.range_observer
    return inner if observer is None else observer(name, inner)


@contextlib.contextmanager
def _profiled_range(name: str, device_handle) -> Iterator[None]:
    with torch.profiler.record_function(name), device_handle.nvtx_range(name):
        yield
