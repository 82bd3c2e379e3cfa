"""benchmarks/engine_cpu_hooks.py's per-range ledger: each outermost engine range's own CPU
time lands under its (unit, hook kind), the waits nested in it subtracted, and the total
equals what the plain CpuTimeLedger reports as the engine's own CPU time."""

import os
import sys
import time

import torch

from megatron.core.distributed.mfsdp_v2 import profiling
from megatron.core.distributed.mfsdp_v2.device import CpuDeviceHandle

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
from engine_cpu_hooks import RangeLedger, mfsdp_key  # noqa: E402


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_range_names_map_to_unit_and_hook():
    assert mfsdp_key("MFSDP decoder.layers.3 pre_backward") == ("decoder.layers.3", "pre_backward")
    assert mfsdp_key("MFSDP <root> post_forward") == ("<root>", "post_forward")
    assert mfsdp_key("MFSDP finish_backward") == ("<root>", "finish")
    assert mfsdp_key("MFSDP stash_grad") == ("", "outside hooks")


def test_own_time_per_range_without_the_waits():
    ledger = RangeLedger()
    device = CpuDeviceHandle(torch.device("cpu"))
    device.range_observer = ledger.measure
    try:
        with profiling.hook_range("MFSDP decoder.layers.0 post_backward", device):
            _spin(0.02)
            with profiling.cpu_range("MFSDP wait reduce_scatter", device):
                _spin(0.03)  # CPU spent inside a wait range: not the engine's own
        with profiling.cpu_range("MFSDP stash_grad", device):
            _spin(0.01)
    finally:
        device.range_observer = None
    own = ledger.by_range[("decoder.layers.0", "post_backward")]
    assert 0.02 <= own < 0.03, own
    assert 0.01 <= ledger.by_range[("", "outside hooks")] < 0.02
    total = sum(ledger.by_range.values())
    assert abs(total - (ledger.cpu_s - ledger.wait_cpu_s)) < 1e-3
