"""The benchmarks' CpuTimeLedger (benchmarks/cpu_time_ledger.py), observing the engine's
ranges (mfsdp_v2/profiling.py) through one device handle: thread CPU time inside the
outermost ranges only, waits apart, and the wall time next to it; nothing recorded once
it is off, nor by another handle."""

import os
import sys
import time

import torch

from megatron.core.distributed.mfsdp_v2 import profiling
from megatron.core.distributed.mfsdp_v2.device import CpuDeviceHandle

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
from cpu_time_ledger import CpuTimeLedger  # noqa: E402


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_outermost_ranges_and_waits_are_measured_apart():
    ledger = CpuTimeLedger()
    device, other = CpuDeviceHandle(torch.device("cpu")), CpuDeviceHandle(torch.device("cpu"))
    device.range_observer = ledger.measure
    try:
        with profiling.hook_range("MFSDP unit post_backward", device):
            _spin(0.02)  # the engine's own work
            with profiling.cpu_range("MFSDP wait reduce_scatter", device):
                time.sleep(0.05)  # blocked: wall time, no CPU time
            with profiling.cpu_range("MFSDP post_ops reduce_scatter", device):  # nested: counted once, in the hook
                _spin(0.01)
        with profiling.cpu_range("MFSDP stash_grad", device):  # outside any hook: an outermost range
            _spin(0.01)
        with profiling.hook_range("MFSDP unit pre_forward", other):  # another context's handle
            _spin(0.01)
    finally:
        device.range_observer = None
    assert ledger.ranges == 2
    assert 0.04 <= ledger.cpu_s < 0.06, ledger.cpu_s
    assert ledger.wait_cpu_s < 0.01 and ledger.wait_wall_s >= 0.05
    assert ledger.wall_s >= ledger.cpu_s + 0.05
    with profiling.hook_range("MFSDP unit pre_forward", device):
        _spin(0.01)
    assert ledger.ranges == 2, "a ledger that was switched off still records"
