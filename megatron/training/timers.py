"""Named wall-clock timers with Megatron-LM's log levels and report format.

``timers(name, level)`` is a context manager; timers above ``--timing-log-level`` cost
nothing. At each log interval the trainer asks for a report of the timers of its level:
every rank contributes its time (a collective), and rank 0 prints them the way Megatron
does (``(min, max) time across ranks (ms):`` / ``max time ...`` / ``times across ranks``)
and, with ``--log-timers-to-tensorboard``, writes ``<name>-time`` (the maximum over ranks).
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.core.distributed.comm_device import comm_device
from megatron.core.distributed.ranks import world_size

# The timers the trainer records, by the --timing-log-level that shows them.
TIMERS_BY_LEVEL = {
    1: ("forward-backward", "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
        "optimizer-count-zeros", "optimizer-inner-step", "optimizer"),
    2: ("batch-generator", "forward-compute", "backward-compute"),
}


def timers_to_log(level: int) -> List[str]:
    return [name for lvl in sorted(TIMERS_BY_LEVEL) if lvl <= level for name in TIMERS_BY_LEVEL[lvl]]


class Timers:
    def __init__(self, log_level: int, log_option: str, device: torch.device):
        self.log_level = log_level
        self.log_option = log_option
        self.device = device
        self._elapsed: Dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str, log_level: int):
        if log_level > self.log_level:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._elapsed[name] = self._elapsed.get(name, 0.0) + time.perf_counter() - start

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _gather(self, names: List[str], normalizer: float) -> torch.Tensor:
        """[world, len(names)] milliseconds per call (-1 where a rank never ran a timer);
        resets the timers."""
        local = torch.tensor([self._elapsed.get(n, -1.0 * normalizer) * 1000.0 / normalizer for n in names],
                             dtype=torch.float64)
        for n in names:
            self._elapsed.pop(n, None)
        if world_size() == 1:
            return local.unsqueeze(0)
        comm = comm_device()
        out = torch.empty(dist.get_world_size() * len(names), dtype=torch.float64, device=comm)
        dist.all_gather_into_tensor(out, local.to(comm))
        return out.view(dist.get_world_size(), len(names)).cpu()

    def report(self, names: List[str], normalizer: float):
        """(text for the log, {"<name>-time": max ms}) over the timers that ran; collective."""
        if not names:
            return "", {}
        times = self._gather(names, normalizer)
        ran = [(i, n) for i, n in enumerate(names) if (times[:, i] >= 0).any()]
        scalars = {f"{n}-time": float(times[:, i].max()) for i, n in ran}
        if not ran:
            return "", scalars
        if self.log_option == "all":
            lines = ["times across ranks (ms):"]
            for i, n in ran:
                lines.append(f"  {n}:")
                lines.extend(f"     rank {r:2d}: {float(times[r, i]):.2f}" for r in range(times.shape[0]))
        elif self.log_option == "max":
            lines = ["max time across ranks (ms):"]
            lines.extend(f"    {(n + ' ').ljust(48, '.')}: {float(times[:, i].max()):.2f}" for i, n in ran)
        else:
            lines = ["(min, max) time across ranks (ms):"]
            lines.extend(f"    {(n + ' ').ljust(48, '.')}: ({float(times[:, i].min()):.2f}, "
                         f"{float(times[:, i].max()):.2f})" for i, n in ran)
        return "\n".join(lines), scalars
