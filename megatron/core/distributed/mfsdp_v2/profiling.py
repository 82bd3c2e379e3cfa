"""Profiler ranges around the engine's hooks, visible on CPU and CUDA alike.

While a torch profiler records, every hook body runs inside a
``torch.profiler.record_function`` range (seen on any device); on CUDA it also runs inside
an NVTX range of the same name (seen by Nsight Systems). Names
follow upstream MFSDP v2's NVTX labels: ``MFSDP <unit name> <hook>``, the root shown as
``<root>``. Each range is a ``with`` block, so it is balanced even when a hook raises.

A ``CpuTimeLedger`` (benchmarks turn one on with ``record_cpu_time``) adds up the thread
CPU time spent inside the outermost ranges, and inside the ``MFSDP wait ...`` ranges among
them: the engine's own CPU work, without the time its thread was blocked on a collective or
descheduled while other threads ran (wall time inside a range counts both).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

import torch


def unit_label(name: Optional[str]) -> str:
    """How a unit appears in range names: its module path, or ``<root>``."""
    return "<root>" if not name else name


class CpuTimeLedger:
    """Thread CPU seconds inside the engine's outermost ranges (``cpu_s``, the waits nested
    in them included) and inside its wait ranges (``wait_cpu_s``); the same ranges' wall
    seconds next to them (``wall_s``, ``wait_wall_s``)."""

    def __init__(self):
        self.cpu_s = self.wait_cpu_s = self.wall_s = self.wait_wall_s = 0.0
        self.ranges = 0
        self._depth = 0

    @contextlib.contextmanager
    def measure(self, name: str, inner) -> Iterator[None]:
        outermost, waiting = self._depth == 0, name.startswith("MFSDP wait ")
        self._depth += 1
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            with inner:
                yield
        finally:
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            self._depth -= 1
            if outermost:
                self.cpu_s += cpu
                self.wall_s += wall
                self.ranges += 1
            if waiting:
                self.wait_cpu_s += cpu
                self.wait_wall_s += wall


_ledger: Optional[CpuTimeLedger] = None


def record_cpu_time(ledger: Optional[CpuTimeLedger]) -> None:
    """Start adding up the ranges' CPU time into ``ledger`` (None: stop). The engine runs
    its hooks on the training thread; ranges of other threads are not meant for it."""
    global _ledger
    _ledger = ledger


def hook_range(name: str, device_handle):
    """The range around one hook body. Without an active torch profiler only the NVTX
    range is opened (nothing at all on CPU): a record_function costs tens of microseconds
    per hook even when nobody records."""
    if torch.autograd._profiler_enabled():
        inner = _profiled_range(name, device_handle)
    else:
        inner = device_handle.nvtx_range(name)
    return inner if _ledger is None else _ledger.measure(name, inner)


def cpu_range(name: str):
    """A CPU-only range (e.g. the host blocked on a collective), recorded only while a
    torch profiler runs: nested in a hook's range, it splits the hook's time into waiting
    and the engine's own work."""
    inner = torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()
    return inner if _ledger is None else _ledger.measure(name, inner)


@contextlib.contextmanager
def _profiled_range(name: str, device_handle) -> Iterator[None]:
    with torch.profiler.record_function(name), device_handle.nvtx_range(name):
        yield
