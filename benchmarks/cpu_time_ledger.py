"""``CpuTimeLedger``: the engine's own CPU time, measured through its profiler ranges.

Set on one context's device handle (``ctx.device_handle.range_observer = ledger.measure``),
it adds up the training thread's CPU time inside the engine's outermost ranges, and inside
the ``MFSDP wait ...`` ranges among them: the engine's own CPU work, without the time its
thread was blocked on a collective or descheduled while other threads ran (wall time inside
a range counts both, and is kept next to it).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator


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
