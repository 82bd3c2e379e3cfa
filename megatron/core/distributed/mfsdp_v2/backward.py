"""The end of a backward pass, for every unit of one context at once.

Units reduce their own gradients as soon as they arrive (``module.py``). What no single
unit can decide lives here: when the whole backward is over (autograd's final callback),
how many reductions may still be in flight while backward continues, and how to return
every unit to rest when a backward raised before its end.
"""

from __future__ import annotations

from typing import Callable, List, Sequence

import torch

from .profiling import hook_range
from .work import CollectiveWork

# Units whose gradient reductions may be in flight at once during backward (the default
# of FsdpContext.max_reductions_in_flight).
MAX_REDUCTIONS_IN_FLIGHT = 1


class BackwardCoordinator:
    """Final callback, reductions in flight, and recovery after an aborted backward."""

    def __init__(self, units: Sequence, device_handle):
        self._units = units  # the context's registry (a live list)
        self._device_handle = device_handle
        self.pending_reductions: List[List[CollectiveWork]] = []  # one batch per unit, oldest first
        # Each reduction in flight keeps its input (the unit's gradients in gathered layout)
        # alive: more overlap of communication with backward compute, more peak memory.
        # 0 completes every reduction before backward continues.
        self.max_reductions_in_flight = MAX_REDUCTIONS_IN_FLIGHT
        self.callback_queued = False

    def ensure_final_callback(self) -> None:
        """Queue ``finish`` to run when autograd's current backward ends (once)."""
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def add_reductions(self, works: List[CollectiveWork]) -> None:
        """Track a unit's reductions; complete those beyond ``max_reductions_in_flight``.

        A reduction in flight keeps its input (a gathered-layout copy of the unit's
        gradients) alive. Holding every unit's until the end of backward would cost about
        the unsharded model in memory; one in flight (FSDP2's rule) still overlaps a
        unit's reduction with the next unit's backward."""
        if works:
            self.pending_reductions.append(list(works))
        while len(self.pending_reductions) > self.max_reductions_in_flight:
            for work in self.pending_reductions.pop(0):
                work.wait()

    def finish(self) -> None:
        """End of backward: reduce what never got gradients, wait, reshard, expose grads."""
        try:
            with hook_range("MFSDP finish_backward", self._device_handle):
                for unit in self._units:
                    unit.fsdp_state.reduce_if_pending()  # unused parameters: their gradient counts as zero
                self._settle(lambda group: group.expose_grads())
        finally:
            self.callback_queued = False

    def recover_from_aborted_backward(self) -> None:
        """A backward raised before its final callback ran: settle the reductions it
        issued and return every unit to rest."""
        self._settle(lambda group: group.discard_partial_backward())
        self.callback_queued = False

    def _settle(self, per_group: Callable) -> None:
        """Wait for every issued reduction, reshard every unit, then ``per_group(group)``."""
        for batch in self.pending_reductions:
            for work in batch:
                work.wait()
        self.pending_reductions.clear()
        for unit in self._units:
            state = unit.fsdp_state
            state.wait_pending_unshard()
            state.reshard()
            for group in state.groups:
                per_group(group)
            state.rest()
