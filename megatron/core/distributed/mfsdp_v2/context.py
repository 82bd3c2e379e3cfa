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

from .backward import BackwardCoordinator
from .device import device_handle_for, resolve_device
from .phase import Phase
from .replica import ReplicaReducer
from .work import CollectiveCounter

_ACTIVE_CONTEXT: contextvars.ContextVar[Optional["FsdpContext"]] = contextvars.ContextVar(
    "mfsdp_v2_active_context", default=None
)

NOT_FINALIZED_MESSAGE = (
    "This FSDP unit's fully_shard_context has not been finalized. Exit fully_shard_context "
    "(leave the `with` block that wrapped the model) before running forward or microbatch; "
    "if the scope exited through an exception, rebuild the model."
)


class FsdpContext:
    """Shared state of every unit built in one ``fully_shard_context`` scope."""

    def __init__(self, device: torch.device, use_symmetric_memory: bool, unify_communication_stream: bool,
                 replica_reducer=None):
        self.device = device
        # The outer replica reduction when replicas are separate jobs (replica.py), else None.
        self.replica_reducer = replica_reducer
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
        self.counter = CollectiveCounter()
        self.backward = BackwardCoordinator(self.units, self.device_handle)
        self._managed_params = {}  # id(original or sharded param) -> unit
        self._sharded_param_ids = set()
        self._param_group = {}  # id(sharded param) -> ParameterGroup

    @property
    def max_reductions_in_flight(self) -> int:
        """Units whose gradient reductions may still run while backward continues (>= 0)."""
        return self.backward.max_reductions_in_flight

    @max_reductions_in_flight.setter
    def max_reductions_in_flight(self, value: int) -> None:
        if int(value) != value or value < 0:
            raise ValueError(f"max_reductions_in_flight must be a whole number >= 0, got {value!r}.")
        self.backward.max_reductions_in_flight = int(value)

    def __repr__(self) -> str:
        return f"FsdpContext(device={self.device}, units={len(self.units)}, finalized={self.finalized})"

    # Construction ---------------------------------------------------------------------
    def _register(self, unit) -> None:
        self.units.append(unit)

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
            root.fsdp_state.is_root = True
            for name, sub in root.named_modules():
                if id(sub) in unit_ids:
                    sub.fsdp_state.set_name(name)
                    sub.fsdp_state.root = root.fsdp_state
        self.forward_order = []
        self.backward_order = []
        for root in self.roots:
            self._collect(root, unit_ids, self.forward_order, reverse=False)
        for root in reversed(self.roots):
            self._collect(root, unit_ids, self.backward_order, reverse=True)
        for index, unit in enumerate(self.forward_order):
            unit.fsdp_state.forward_index = index
        for index, unit in enumerate(self.backward_order):
            unit.fsdp_state.backward_index = index
        self.finalized = True

    def _collect(self, module, unit_ids, out: List, reverse: bool) -> None:
        """Pre-order walk over units below ``module``; children reversed for backward."""
        if id(module) in unit_ids:
            out.append(module)
        children = list(module.children())
        for child in reversed(children) if reverse else children:
            self._collect(child, unit_ids, out, reverse)

    def group_of(self, param):
        """The ParameterGroup that owns a sharded parameter, or None."""
        return self._param_group.get(id(param))

    def check_finalized(self) -> None:
        if not self.finalized:
            raise RuntimeError(NOT_FINALIZED_MESSAGE)

    @property
    def is_last_microbatch(self) -> bool:
        """True unless a ``microbatch(..., is_last=False)`` scope covers every root."""
        return any(root.fsdp_state.is_last_microbatch for root in self.roots) if self.roots else True

    # Prefetch -------------------------------------------------------------------------
    def _prefetch_after(self, state, index: int, order: List) -> None:
        # Only within the unit's own root: separate roots are separately scheduled model
        # pieces (pipeline chunks), and which of them runs next is the schedule's choice,
        # not the static order's. A unit whose gradients were already reduced in this
        # backward (it ran earlier than the static order predicts) needs no parameters any
        # more: gathering it again would keep it unsharded until the end of backward.
        if index < len(order):
            nxt = order[index].fsdp_state
            if nxt.root is state.root and nxt.phase is not Phase.POST_BACKWARD:
                nxt.issue_unshard()

    def prefetch_forward(self, state) -> None:
        self._prefetch_after(state, state.forward_index + 1, self.forward_order)

    def prefetch_backward(self, state) -> None:
        self._prefetch_after(state, state.backward_index + 1, self.backward_order)

    def reshard_all(self) -> None:
        """Reshard every unit (e.g. after a forward without gradients)."""
        for unit in self.units:
            unit.fsdp_state.wait_pending_unshard()
            unit.fsdp_state.reshard()

    def persistent_bytes(self) -> dict:
        total: dict = {}
        for unit in self.units:
            for group in unit.fsdp_state.groups:
                for key, value in group.persistent_bytes().items():
                    total[key] = total.get(key, 0) + value
        return total


@contextlib.contextmanager
def fully_shard_context(
    device: Optional[torch.device | str | int] = None,
    *,
    use_symmetric_memory: bool = False,
    unify_communication_stream: bool = False,
    replica_reducer=None,
) -> Iterator[FsdpContext]:
    """The construction scope every ``fully_shard`` call must run in.

    Entering creates the context and its communication streams (all-gather and
    reduce-scatter). On a clean exit the context is finalized: it finds the roots (units
    no other unit contains), names every unit by its module path, and builds the static
    forward and backward prefetch orders. Only then may the model run.

    Args:
        device: where the model computes: ``None`` means the current accelerator device,
            or CPU when there is none; an int means that CUDA device.
        use_symmetric_memory: accepted for source compatibility with upstream; this
            implementation does not use symmetric-memory collectives.
        unify_communication_stream: issue all-gathers and reduce-scatters on one stream
            instead of two (upstream's flag; it serializes them).
        replica_reducer: a ``replica.ReplicaReducer``: on each step's last microbatch every
            reduced gradient is also summed over the live replicas through it and divided
            by their number (HSDP whose replica axis is another job's, e.g. torchft's).

    Yields:
        The ``FsdpContext`` (pass it to ``microbatch``; ``context.roots``, ``units``).

    Raises:
        RuntimeError: a scope is already open (scopes do not nest).
        NotImplementedError: a device other than CUDA or CPU.

    A scope left through an exception stays unfinalized; its modules refuse to run.
    """
    if _ACTIVE_CONTEXT.get() is not None:
        raise RuntimeError(
            "fully_shard_context does not support nesting: wrap every module of a model inside "
            "one scope, and open the next scope only after the previous one exited."
        )
    if replica_reducer is not None and not isinstance(replica_reducer, ReplicaReducer):
        raise TypeError(f"replica_reducer must have all_reduce_sum(tensor) and live_replicas(), "
                        f"got {type(replica_reducer).__name__}.")
    context = FsdpContext(resolve_device(device), use_symmetric_memory, unify_communication_stream,
                          replica_reducer)
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
def microbatch(context: FsdpContext, is_last: bool, module: Optional[torch.nn.Module] = None) -> Iterator[None]:
    """Run one microbatch's forward and backward; reductions that only need to happen
    once per step (HSDP/HFSDP outer, ZeRO-1, no_shard) happen when ``is_last`` is True.
    Outside any ``microbatch`` scope every backward counts as the last one.

    Args:
        context: the ``FsdpContext`` of ``fully_shard_context``.
        is_last: whether this is the step's last microbatch (of ``module``).
        module: a root of ``context`` (e.g. one pipeline chunk) that the flag applies to;
            None applies it to every root. A pipeline schedule runs the backwards of one
            chunk's microbatches interleaved with other chunks', so each chunk has its own
            last microbatch.

    Raises:
        TypeError: ``context`` is not an ``FsdpContext``.
        ValueError: ``module`` is not a root of ``context``.
        RuntimeError: the context's scope has not been finalized.
    """
    if not isinstance(context, FsdpContext):
        raise TypeError(f"microbatch expects the FsdpContext from fully_shard_context, got {type(context).__name__}.")
    context.check_finalized()
    if module is None:
        roots = list(context.roots)
    elif any(module is root for root in context.roots):
        roots = [module]
    else:
        raise ValueError(
            f"microbatch(module=...) got a {type(module).__name__} that is not a root of this context; pass one "
            "of context.roots (a module given to fully_shard that no other unit contains), or module=None."
        )
    previous = [root.fsdp_state.is_last_microbatch for root in roots]
    for root in roots:
        root.fsdp_state.is_last_microbatch = bool(is_last)
    try:
        yield
    finally:
        for root, flag in zip(roots, previous):
            root.fsdp_state.is_last_microbatch = flag
