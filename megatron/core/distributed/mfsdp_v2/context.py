"""The explicit construction scope: ``fully_shard_context`` and its ``FsdpContext``.

Everything that lazy FSDP implementations decide at the first forward is decided here,
eagerly and in one place: the communication streams exist as soon as the scope opens, and
on a clean exit the roots, unit names and static forward/backward prefetch orders are
fixed. A scope that exits through an exception is not finalized, so its units refuse to
run instead of running half-configured.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, List, Optional

import torch

from .device import device_handle_for, resolve_device
from .work import CollectiveCounter, CollectiveWork

_ACTIVE_CONTEXT: contextvars.ContextVar[Optional["FsdpContext"]] = contextvars.ContextVar(
    "mfsdp_v2_active_context", default=None
)

# Units whose gradient reductions may be in flight at once during backward (the default
# of FsdpContext.max_reductions_in_flight).
MAX_REDUCTIONS_IN_FLIGHT = 1

NOT_FINALIZED_MESSAGE = (
    "This FSDP unit's fully_shard_context has not been finalized. Exit fully_shard_context "
    "(leave the `with` block that wrapped the model) before running forward or microbatch; "
    "if the scope exited through an exception, rebuild the model."
)


class FsdpContext:
    """Shared state of every unit built in one ``fully_shard_context`` scope."""

    def __init__(self, device: torch.device, use_symmetric_memory: bool, unify_communication_stream: bool):
        self.device = device
        self.device_handle = device_handle_for(device)  # tests may substitute it: device.handles_from
        self.use_symmetric_memory = use_symmetric_memory
        self.unify_communication_stream = unify_communication_stream
        # Streams are created eagerly, once, and shared by every unit of this context.
        self.allgather_stream = self.device_handle.new_stream("allgather")
        self.reduce_scatter_stream = (
            self.allgather_stream if unify_communication_stream else self.device_handle.new_stream("reduce_scatter")
        )
        self.units: List = []  # FsdpModule, in registration order
        self.roots: List = []
        self.forward_order: List = []
        self.backward_order: List = []
        self.finalized = False
        self.is_last_microbatch = True
        self.counter = CollectiveCounter()
        # Set by fully_shard_optimizer(precision_aware=True): .grad keeps main_grads_dtype.
        self.precision_aware_grads = False
        self._pending_reductions: List[List[CollectiveWork]] = []  # one batch per unit, oldest first
        # Each reduction in flight keeps its input (the unit's gradients in gathered layout)
        # alive: more overlap of communication with backward compute, more peak memory.
        # 0 completes every reduction before backward continues.
        self.max_reductions_in_flight = MAX_REDUCTIONS_IN_FLIGHT
        self._backward_callback_queued = False
        self._group_owner = {}  # id(ParameterGroup) -> unit
        self._managed_params = {}  # id(original or sharded param) -> unit
        self._sharded_param_ids = set()
        self._param_group = {}  # id(sharded param) -> ParameterGroup

    def __repr__(self) -> str:
        return f"FsdpContext(device={self.device}, units={len(self.units)}, finalized={self.finalized})"

    # Construction ---------------------------------------------------------------------
    def _register(self, unit) -> None:
        self.units.append(unit)
        for group in unit._fsdp_state.groups:
            self._group_owner[id(group)] = unit

    def _finalize(self) -> None:
        """Find roots, name units and build the static prefetch orders."""
        unit_ids = {id(u) for u in self.units}
        inside_other = set()
        for unit in self.units:
            for sub in unit.modules():
                if sub is not unit and id(sub) in unit_ids:
                    inside_other.add(id(sub))
        self.roots = [u for u in self.units if id(u) not in inside_other]
        for root in self.roots:
            for name, sub in root.named_modules():
                if id(sub) in unit_ids:
                    sub._fsdp_state.name = name
        self.forward_order = []
        self.backward_order = []
        for root in self.roots:
            self._collect(root, unit_ids, self.forward_order, reverse=False)
        for root in reversed(self.roots):
            self._collect(root, unit_ids, self.backward_order, reverse=True)
        for index, unit in enumerate(self.forward_order):
            unit._fsdp_state.forward_index = index
        for index, unit in enumerate(self.backward_order):
            unit._fsdp_state.backward_index = index
        self.finalized = True

    def _collect(self, module, unit_ids, out: List, reverse: bool) -> None:
        """Pre-order walk over units below ``module``; children reversed for backward."""
        if id(module) in unit_ids:
            out.append(module)
        children = list(module.children())
        for child in reversed(children) if reverse else children:
            self._collect(child, unit_ids, out, reverse)

    def check_finalized(self) -> None:
        if not self.finalized:
            raise RuntimeError(NOT_FINALIZED_MESSAGE)

    # Prefetch -------------------------------------------------------------------------
    def _prefetch_after(self, unit, order: List, index_attr: str) -> None:
        index = getattr(unit._fsdp_state, index_attr) + 1
        # A unit whose gradients were already reduced in this backward (it ran earlier than
        # the static order predicts) needs no parameters any more: gathering it again would
        # keep it unsharded until the end of backward.
        if index < len(order) and not order[index]._fsdp_state.reduced_this_backward:
            order[index]._fsdp_state.issue_unshard()

    def prefetch_forward(self, unit) -> None:
        self._prefetch_after(unit, self.forward_order, "forward_index")

    def prefetch_backward(self, unit) -> None:
        self._prefetch_after(unit, self.backward_order, "backward_index")

    # Backward bookkeeping -------------------------------------------------------------
    def _ensure_backward_callback(self) -> None:
        if not self._backward_callback_queued:
            self._backward_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_grad_ready(self, group) -> None:
        self._ensure_backward_callback()
        unit = self._group_owner[id(group)]
        state = unit._fsdp_state
        if not state.reduced_this_backward and all(g.all_grads_received() for g in state.trainable_groups):
            state.post_backward()

    def _add_reductions(self, works: List[CollectiveWork]) -> None:
        """Track a unit's reductions; complete those beyond ``max_reductions_in_flight``.

        A reduction in flight keeps its input (a gathered-layout copy of the unit's
        gradients) alive. Holding every unit's until the end of backward would cost about
        the unsharded model in memory; one in flight (FSDP2's rule) still overlaps a
        unit's reduction with the next unit's backward."""
        if works:
            self._pending_reductions.append(list(works))
        while len(self._pending_reductions) > self.max_reductions_in_flight:
            for work in self._pending_reductions.pop(0):
                work.wait()

    def _finish_backward(self) -> None:
        """End of backward: reduce what never got gradients, wait, reshard, expose grads."""
        try:
            for unit in self.units:
                state = unit._fsdp_state
                if state.trainable_groups and not state.reduced_this_backward:
                    state.post_backward()  # unused parameters: their gradient counts as zero
            self._settle_backward(lambda group: group.expose_grads())
        finally:
            self._backward_callback_queued = False

    def _recover_from_aborted_backward(self) -> None:
        """A backward raised before its end-of-backward callback ran: settle the
        reductions it issued and return every unit to its resting state."""
        self._settle_backward(lambda group: group.discard_partial_backward())
        self._backward_callback_queued = False

    def _settle_backward(self, per_group) -> None:
        """Wait for every issued reduction, reshard every unit, then ``per_group(group)``."""
        for batch in self._pending_reductions:
            for work in batch:
                work.wait()
        self._pending_reductions.clear()
        for unit in self.units:
            state = unit._fsdp_state
            state.wait_pending_unshard()
            state.reshard()
            for group in state.groups:
                per_group(group)
            state.reset_backward_state()

    def reshard_all(self) -> None:
        """Reshard every unit (e.g. after a forward without gradients)."""
        for unit in self.units:
            unit._fsdp_state.wait_pending_unshard()
            unit._fsdp_state.reshard()

    def persistent_bytes(self) -> dict:
        total: dict = {}
        for unit in self.units:
            for group in unit._fsdp_state.groups:
                for key, value in group.persistent_bytes().items():
                    total[key] = total.get(key, 0) + value
        return total


@contextlib.contextmanager
def fully_shard_context(
    device: Optional[torch.device | str | int] = None,
    *,
    use_symmetric_memory: bool = False,
    unify_communication_stream: bool = False,
) -> Iterator[FsdpContext]:
    """The construction scope every ``fully_shard`` call must run in.

    ``device=None`` means the current accelerator device, or CPU when there is none.
    ``use_symmetric_memory`` is accepted for source compatibility; symmetric-memory
    collectives are not used by this implementation.
    """
    if _ACTIVE_CONTEXT.get() is not None:
        raise RuntimeError(
            "fully_shard_context does not support nesting: wrap every module of a model inside "
            "one scope, and open the next scope only after the previous one exited."
        )
    context = FsdpContext(resolve_device(device), use_symmetric_memory, unify_communication_stream)
    token = _ACTIVE_CONTEXT.set(context)
    try:
        yield context
    finally:
        _ACTIVE_CONTEXT.reset(token)
    # Reached only on a clean exit: a scope left through an exception stays unfinalized.
    context._finalize()


def current_fully_shard_context() -> Optional[FsdpContext]:
    """The context of the active ``fully_shard_context`` scope, or None outside one."""
    return _ACTIVE_CONTEXT.get()


@contextlib.contextmanager
def microbatch(context: FsdpContext, is_last: bool) -> Iterator[None]:
    """Run one microbatch's forward and backward; reductions that only need to happen
    once per step (HSDP/HFSDP outer, ZeRO-1, no_shard) happen when ``is_last`` is True."""
    if not isinstance(context, FsdpContext):
        raise TypeError(f"microbatch expects the FsdpContext from fully_shard_context, got {type(context).__name__}.")
    context.check_finalized()
    previous = context.is_last_microbatch
    context.is_last_microbatch = bool(is_last)
    try:
        yield
    finally:
        context.is_last_microbatch = previous
