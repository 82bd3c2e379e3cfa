"""The end of a backward pass, for every unit that took part in it.

Units reduce their own gradients as soon as they arrive (``module.py``). What no single
unit can decide lives here: when the whole backward is over (autograd's final callback),
how many reductions may still be in flight while backward continues, and how to return
every unit to rest when a backward raised before its end.

A backward belongs to the roots whose units it reached: a pipeline schedule runs one
chunk's (one root's) backward while other chunks of the same context hold microbatches
whose backward is still to come, so the end of a backward settles only its own roots.
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
        # Root states (UnitState.root) of the units this backward reached, in first-seen order.
        self._roots_in_backward: List = []
        # Units whose gradients all came from a nested graph: reduced at the next unit's
        # pre-backward, at their own next gradient, or at the end of backward.
        self._deferred_post_backwards: List = []

    def ensure_final_callback(self, unit_state) -> None:
        """``unit_state`` takes part in the current backward: queue ``finish`` to run when
        autograd's backward ends (once), and make the unit's root one that it settles."""
        if not any(unit_state.root is root for root in self._roots_in_backward):
            self._roots_in_backward.append(unit_state.root)
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def defer_post_backward(self, unit_state) -> None:
        if unit_state not in self._deferred_post_backwards:
            self._deferred_post_backwards.append(unit_state)

    def run_deferred_post_backwards(self, moving_on_from) -> None:
        """Another unit's backward begins: reduce the deferred units (but the one whose
        backward continues here)."""
        if not self._deferred_post_backwards:  # the usual case, on every pre-backward hook
            return
        units = [u for u in self._deferred_post_backwards if u is not moving_on_from]
        self._deferred_post_backwards = [u for u in self._deferred_post_backwards if u is moving_on_from]
        for unit_state in units:
            unit_state.reduce_if_pending()

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
                self._deferred_post_backwards.clear()  # reduce_if_pending covers them
                units = self._units_in_backward()
                for unit in units:
                    unit.fsdp_state.reduce_if_pending()  # unused parameters: their gradient counts as zero
                self._settle(units, lambda group: group.expose_grads(), reshard_kept=False)
        finally:
            self.callback_queued = False
            self._roots_in_backward = []

    def _units_in_backward(self) -> List:
        roots = self._roots_in_backward
        return [unit for unit in self._units if any(unit.fsdp_state.root is root for root in roots)]

    def recover_from_aborted_backward(self) -> None:
        """A backward raised before its final callback ran: settle the reductions it
        issued and return every unit to rest."""
        self._deferred_post_backwards.clear()
        self._settle(self._units, lambda group: group.discard_partial_backward(), reshard_kept=True)
        self.callback_queued = False
        self._roots_in_backward = []

    def _settle(self, units: Sequence, per_group: Callable, reshard_kept: bool) -> None:
        """Wait for every issued reduction, reshard ``units`` (but those kept gathered for
        their root's next microbatch, unless ``reshard_kept``), then ``per_group(group)``."""
        for batch in self.pending_reductions:
            for work in batch:
                work.wait()
        self.pending_reductions.clear()
        for unit in units:
            state = unit.fsdp_state
            state.wait_pending_unshard()
            if reshard_kept or not state.keeps_gathered():
                state.reshard()
            for group in state.groups:
                per_group(group)
            state.rest()
