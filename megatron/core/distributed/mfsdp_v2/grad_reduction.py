"""A group's gradients: from autograd's unsharded ``.grad`` to the reduced ``.grad`` the
optimizer reads.

``GradientReducer`` is one part of a ``ParameterGroup``. A gradient starts as this rank's
partial sum on every axis ("P" everywhere); each microbatch takes it to the strategy's
gradient placement (a reduce-scatter into ``main_grad`` where that is Shard(0), local
accumulation where it is Partial), and the last microbatch takes ``main_grad`` on to the
optimizer placement in ``reduced_grad``, inner axis first (``single_axis_steps``):

    inner Partial -> Shard       ZeRO-1: reduce-scatter the local sum
    inner Partial -> Replicate   no_shard: all-reduce in place
    outer Partial -> Replicate   HSDP: all-reduce in place
    outer Partial -> Shard       HFSDP: reduce-scatter of the inner shard
    replicas (another job's)     with a replica reducer (replica.py): all-reduce in place

The reducer also stashes each gradient into the reduce-scatter input as it arrives and
exposes ``.grad``/``.main_grad`` at the end of backward.

Gradient-accumulation fusion: a linear layer's backward may ask for the place of its weight
gradient in that input (``unsharded_param.fused_wgrad_out()``, see
``megatron.core.tensor_parallel.grad_accumulation_fusion``), compute the gradient straight
into it and return that very tensor to autograd; the hook then finds it already in place
and copies nothing. A tied embedding's backward, which runs after the output layer's, gives
the gradient of the rows its batch touches to ``unsharded_param.add_to_fused_wgrad(...)``
instead of giving autograd a vocabulary-sized one: they are added into those rows of the
slot when the slot is delivered.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron.core.torch_private import current_graph_task_id

from . import work as comm
from .flat_buffer import CommResources, DataParallelAxes, single_axis_steps
from .group_buffers import GroupBuffers
from .layout import FlatLayout
from .mixed_precision import ResolvedPrecision
from .phase import GradPhase, check_grad_transition
from .profiling import cpu_range
from .replica import replica_all_reduce
from .shard_views import ShardViews


@dataclasses.dataclass
class _BackwardGrads:
    """What one backward has delivered of a group's gradients and not yet reduced."""

    received: set = dataclasses.field(default_factory=set)  # indices whose gradient was accumulated
    # Sharded gradients: each unsharded gradient is moved into the reduce-scatter input as
    # soon as autograd has accumulated it, so the unit never holds its gradients and that
    # input at the same time.
    reduce_input: Optional[torch.Tensor] = None
    stashed: set = dataclasses.field(default_factory=set)  # indices already in reduce_input
    # Parameters whose fused gradient slot was handed out and not yet seen by the hook:
    # index -> the autograd graph task that computed into it.
    slots_out: Dict[int, int] = dataclasses.field(default_factory=dict)
    # index -> [(rows or None, gradient)] waiting for that slot's own graph to deliver it
    deferred: Dict[int, list] = dataclasses.field(default_factory=dict)


class GradientReducer:
    """Reduction of one group's gradients into ``main_grad`` and ``reduced_grad``.

    Owns: the step's gradient lifecycle ``phase`` (``GradPhase``; every change goes through
    ``_set_phase``), the set of parameters whose next reduction overwrites, this backward's
    delivered gradients (``_BackwardGrads``), the cached ``.grad`` DTensor views, the
    gradient hook and the fused-wgrad slots. Settings its group forwards: ``on_grad_ready``
    (called when one of its gradients was accumulated) and ``precision_aware_grads``.
    Reads, never reallocates: ``main_grad``/``reduced_grad`` and the views into them."""

    def __init__(self, params, layout: FlatLayout, shard_index: int, outer_layout: Optional[FlatLayout],
                 strategy, precision: ResolvedPrecision, resources: CommResources, axes: DataParallelAxes,
                 grad_divisor: float, buffers: GroupBuffers, views: ShardViews, requires_grad: bool):
        self.fsdp_parameters = params
        self.layout, self.shard_index, self.outer_layout = layout, shard_index, outer_layout
        self.strategy, self.precision, self.grad_divisor = strategy, precision, grad_divisor
        self.resources, self.device, self.axes = resources, resources.device, axes
        self.main_grad, self.reduced_grad = buffers.main_grad, buffers.reduced_grad
        self.views, self.requires_grad = views, requires_grad
        # Set through the group by the owning unit: called when one of its gradients was accumulated.
        self.on_grad_ready: Callable[[], None] = lambda: None
        # Set through the group by fully_shard_optimizer(precision_aware=True): .grad keeps main_grads_dtype.
        self.precision_aware_grads = False
        S = layout.shard_numel
        # Fixed per group, used on every step: computed once.
        self._padding_ranges = [
            (s * S + used, S - used)
            for s, used in ((s, layout.used_numel(s)) for s in range(layout.num_shards))
            if used < S
        ]
        self._num_trainable = sum(1 for p in params if p.requires_grad)
        self._stash_grads = requires_grad and strategy.grad_sharded
        self.phase = GradPhase.IDLE
        # Parameters whose next reduction overwrites instead of accumulating (their .grad was
        # reset since it was exposed): set when a step's accumulation begins, taken once by
        # the reduction that writes them (_take_overwrite).
        self._overwrite: set = set()
        self._backward = _BackwardGrads()
        self._grad_views = None  # reduced_grad's DTensor views, built at the first expose

    def _set_phase(self, new: GradPhase) -> None:
        check_grad_transition(self.fsdp_parameters[0].fqns[0], self.phase, new)
        self.phase = new

    def _reduced_in_backward(self) -> bool:
        return self.phase in (GradPhase.REDUCED, GradPhase.READY)

    def _take_overwrite(self) -> set:
        """The parameters the current reduction must overwrite; later ones accumulate."""
        taken, self._overwrite = self._overwrite, set()
        return taken

    def make_grad_hook(self, p):
        # The hook lives in the parameter's C++ autograd metadata, where Python's garbage
        # collector cannot see it: a hook holding this reducer (which holds the parameter)
        # would make a cycle that is never freed, and keep the model, its buffers and its
        # mesh's process groups alive for the rest of the process. So it holds the reducer weakly.
        reducer_ref = weakref.ref(self)
        position = self.fsdp_parameters.index(p)

        def hook(param: torch.Tensor) -> None:
            reducer = reducer_ref()
            if reducer is not None:
                reducer._on_grad_accumulated(reducer.fsdp_parameters[position])

        return hook

    def _on_grad_accumulated(self, p) -> None:
        if self._reduced_in_backward():
            raise RuntimeError(
                f"MFSDP v2: {p.fqns[0]} received a gradient after its unit had reduced this backward's "
                "gradients: two autograd graphs use it (e.g. inside and outside a reentrant activation "
                "checkpoint that does not cover the unit's whole use of it); use "
                "torch.utils.checkpoint(..., use_reentrant=False) there.")
        self._backward.received.add(p.index)
        if self._stash_grads:
            with cpu_range("MFSDP stash_grad", self.device):
                self._stash_grad(p)
        self.on_grad_ready()

    def all_grads_received(self) -> bool:
        return len(self._backward.received) == self._num_trainable

    def _pending_reduce_input(self) -> torch.Tensor:
        if self._backward.reduce_input is None:
            self._backward.reduce_input = torch.empty(
                self.layout.gathered_numel, dtype=self.precision.grad_comm, device=self.main_grad.device
            )
        return self._backward.reduce_input

    def fused_wgrad_out(self, p) -> Optional[torch.Tensor]:
        """The tensor a fused linear backward may write ``p``'s whole gradient into (its place
        in the pending reduce-scatter input; offered only where gradients are sharded), or
        None: this backward already holds a gradient of ``p``, the shard padding splits ``p``
        there, or the dtypes differ. Handing it out counts as ``p``'s first gradient. It is a
        fresh view that nothing else holds, so autograd keeps it as ``.grad`` uncopied."""
        index = p.index
        unsharded = p.unsharded_param
        if (index in self._backward.stashed or self.layout.replicated[index]
                or not self.layout.is_contiguous_in_gathered(index)
                or unsharded.dtype != self.precision.grad_comm or unsharded.grad is not None):
            return None
        self._backward.stashed.add(index)
        self._backward.slots_out[index] = current_graph_task_id()
        return self.layout.gathered_view(self._pending_reduce_input(), index)

    def add_to_fused_wgrad(self, p, touched_rows: Callable[[], Tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Take another gradient of ``p`` from this backward, to add into ``p``'s fused slot
        when autograd delivers the slot (True), or decline (False: no slot of this graph is
        out, so the gradient must go through autograd). ``touched_rows()`` computes it, only
        once accepted, as ``(rows, values)``: ``values[i]`` belongs to row ``rows[i]``, rows
        distinct. A slot is only ever handed out in the gradient's dtype."""
        if self._backward.slots_out.get(p.index) != current_graph_task_id():
            return False
        self._backward.deferred.setdefault(p.index, []).append(touched_rows())
        return True

    def _stash_grad(self, p) -> None:
        """Move ``p``'s fresh unsharded gradient into the pending reduce-scatter input."""
        grad = p.unsharded_param.grad
        if grad is None:
            return
        index = p.index
        with torch.no_grad():
            flat = self._pending_reduce_input()
            slot_task = self._backward.slots_out.get(index)
            if slot_task is not None and slot_task != current_graph_task_id():
                # A nested graph (reentrant recompute) delivers before the graph that holds the
                # fused slot, which may still be summing the slot's value: add this one after.
                self._backward.deferred.setdefault(index, []).append((None, grad))
            elif slot_task is not None:
                del self._backward.slots_out[index]
                if grad.data_ptr() != self.layout.gathered_view(flat, index).data_ptr():
                    # Autograd summed the slot with other gradients of ``p`` (a tied weight)
                    # into a new tensor: the sum replaces the slot.
                    self.layout.copy_in(grad, flat, index)
                self._add_deferred(flat, index, self._backward.deferred.pop(index, ()))
            elif index in self._backward.stashed:  # a second gradient in this backward (reentrant graphs)
                self._add_into(flat, index, grad)
            else:
                self.layout.copy_in(grad, flat, index)
                self._backward.stashed.add(index)
        p.unsharded_param.grad = None

    def _add_into(self, flat: torch.Tensor, index: int, grad: torch.Tensor) -> None:
        for piece, src in zip(self.layout.gathered_slices(flat, index), self.layout.source_chunks(grad, index)):
            piece.add_(src)

    def _add_deferred(self, flat: torch.Tensor, index: int, held) -> None:
        """Add the gradients held back for ``index``'s slot: whole ones (a nested graph's) or
        the rows a tied embedding touched."""
        for rows, grad in held:
            if rows is None:
                self._add_into(flat, index, grad)
            else:  # offered only for a slot, which is contiguous in the buffer
                self.layout.gathered_view(flat, index).index_add_(0, rows, grad)

    def reduce_grads(self, is_last_microbatch: bool) -> List[comm.CollectiveWork]:
        """Reduce this backward's gradients into main_grad (missing gradients count as zero)."""
        if not self.requires_grad:
            return []
        strategy = self.strategy
        # This backward's gradients are taken whole; the next backward starts afresh.
        backward, self._backward = self._backward, _BackwardGrads()
        if self.phase is GradPhase.IDLE:
            self._begin_accumulation()
        # What the end of this backward exposes as .grad: the last microbatch's result, or
        # every microbatch's where main_grad already has the optimizer's placement.
        exposes = is_last_microbatch or strategy.gradient == strategy.optimizer
        self._set_phase(GradPhase.READY if exposes else GradPhase.REDUCED)
        works: List[comm.CollectiveWork] = []
        if strategy.grad_sharded:
            works.append(self._reduce_scatter_microbatch(backward))
        else:
            # Accumulate locally. no_shard reduces in place, on top of what earlier backwards
            # already reduced, and the all-reduce divides the whole buffer: so grad_divisor is
            # applied to the new local gradients here and the all-reduce divides by the rank
            # count only.
            in_place = not strategy.optim_sharded
            self._take_grads_into(self.main_grad, accumulate=True, scale=1 / self.grad_divisor if in_place else 1)
        if is_last_microbatch:
            for axis, before, after in single_axis_steps(strategy.gradient, strategy.optimizer):
                works.append(self._last_microbatch_step(axis, before, after, works[-1] if works else None))
            if self.resources.replica_reducer is not None:
                works.append(self._replica_step(works[-1] if works else None))
        return works

    def _replica_step(self, previous: Optional[comm.CollectiveWork]) -> comm.CollectiveWork:
        """Last microbatch, after this group's own reductions: the outer replica reduction
        through the context's replica reducer (replica.py), in grad_comm_dtype. Like HSDP's
        outer all-reduce it averages reduced_grad in place (over the live replicas)."""
        reducer, stream = self.resources.replica_reducer, self.resources.reduce_scatter_stream
        if previous is not None:  # it reads what the group's reductions wrote
            with self.device.stream(stream):
                previous.wait()
        buffer, comm_dtype = self.reduced_grad, self.precision.grad_comm
        kwargs = dict(device=self.device, stream=stream, counter=self.resources.counter)
        if buffer.dtype == comm_dtype:
            return replica_all_reduce(buffer, reducer, **kwargs)
        comm.follow_current_stream(self.device, stream)  # the buffer may have been written there
        with self.device.stream(stream):
            wire = buffer.to(comm_dtype)

        def copy_back() -> None:
            buffer.copy_(wire)

        return replica_all_reduce(wire, reducer, post_ops=[copy_back], **kwargs)

    def _begin_accumulation(self) -> None:
        """Once per step (the first reduction after .grad was exposed): a parameter whose
        .grad was set to None starts a fresh accumulation; a .grad that is a cast copy
        (mixed precision) may have been changed in place (zero_grad(set_to_none=False),
        clipping), so its values become the base of the accumulation."""
        for p in self.fsdp_parameters:
            if self._grad_was_reset(p):
                self._overwrite.add(p.index)
            elif p.sharded_param.grad is not p.sharded_param.main_grad and p.sharded_param.grad is not None:
                with torch.no_grad():
                    self.views.optim_view(self.reduced_grad, p).copy_(p.sharded_param.grad.to_local())

    def _reduce_scatter_microbatch(self, backward: _BackwardGrads) -> comm.CollectiveWork:
        """Partial -> the gradient placement's Shard(0) on the inner axis, into main_grad."""
        ctx, comm_dtype = self.resources, self.precision.grad_comm
        flat = backward.reduce_input
        if flat is None:
            flat = torch.empty(self.layout.gathered_numel, dtype=comm_dtype, device=self.main_grad.device)
        with torch.no_grad():
            for index, held in backward.deferred.items():  # a slot whose graph never delivered still holds its gradient
                self._add_deferred(flat, index, held)
        self._take_grads_into(flat, skip=backward.stashed)
        local = self.axes.flat(flat, "P" * len(self.axes.groups))
        divisor = self.axes.inner_size * self.grad_divisor
        # HFSDP accumulates a local partial sum here and reduces it on the outer axis
        # later; every other strategy accumulates straight into the reduced gradient.
        direct = self.main_grad is self.reduced_grad
        trainable = {p.index for p in self.fsdp_parameters if p.requires_grad}
        overwrite = self._take_overwrite() if direct else set()
        if direct and comm_dtype == self.main_grad.dtype and trainable <= overwrite:
            # Every slice starts fresh (the usual step after zero_grad()): reduce straight
            # into main_grad, with no extra buffer and no accumulate pass.
            return local.redistribute(local.like(self.main_grad, self.strategy.gradient), ctx,
                                      ctx.reduce_scatter_stream, divisor=divisor)
        with self.device.stream(ctx.reduce_scatter_stream):
            out = torch.empty(self.layout.shard_numel, dtype=comm_dtype, device=flat.device)
        return local.redistribute(
            local.like(out, self.strategy.gradient), ctx, ctx.reduce_scatter_stream,
            post_ops=[self._accumulate_op(out, self.main_grad, overwrite, scale=1 / divisor)],
        )

    def _last_microbatch_step(self, axis: int, before: str, after: str,
                              previous: Optional[comm.CollectiveWork]) -> comm.CollectiveWork:
        ctx, stream = self.resources, self.resources.reduce_scatter_stream
        if axis != len(self.axes.groups) - 1:
            # The outer reduction reads what the inner one wrote: order them (stream-ordered
            # on CUDA; on CPU this completes the inner reduction first).
            with self.device.stream(stream):
                previous.wait()
            if after[axis] == "R":  # HSDP: content left from earlier steps is identical on
                # every outer rank, so SUM / M keeps it and averages the new gradients onto it.
                return self._all_reduce_in_comm_dtype(self.reduced_grad, before, after, self.axes.outer_size)
            return self._outer_reduce_scatter(before, after)
        if after[axis] == "R":  # no_shard: all-reduce in place. Content left from earlier steps
            # is identical on every rank, so SUM / N returns it unchanged and new gradients are
            # averaged onto it.
            return self._all_reduce_in_comm_dtype(self.main_grad, before, after, self.axes.inner_size)
        # ZeRO-1: reduce-scatter the local sum into the shard.
        comm_dtype = self.precision.grad_comm
        comm.follow_current_stream(self.device, stream)  # main_grad was written there
        with self.device.stream(stream):
            out = torch.empty(self.layout.shard_numel, dtype=comm_dtype, device=self.main_grad.device)
            send = self.axes.flat(self.main_grad.to(comm_dtype), before)
        local = self.main_grad

        def clear_local() -> None:
            local.zero_()

        return send.redistribute(
            send.like(out, after), ctx, stream, divisor=self.axes.inner_size * self.grad_divisor,
            post_ops=[self._accumulate_op(out, self.reduced_grad, self._take_overwrite()), clear_local],
        )

    def _outer_reduce_scatter(self, before: str, after: str) -> comm.CollectiveWork:
        """HFSDP, last microbatch: reduce-scatter the inner shard's partial sum over the outer axis."""
        stream = self.resources.reduce_scatter_stream
        with self.device.stream(stream):
            flat = torch.zeros(self.outer_layout.gathered_numel, dtype=self.precision.grad_comm, device=self.main_grad.device)
            for piece_index, piece in enumerate(self.layout.pieces_by_shard[self.shard_index]):
                local = self.main_grad.narrow(0, piece.offset, piece.numel)
                self.outer_layout.copy_in(local, flat, piece_index)
            out = torch.empty(self.outer_layout.shard_numel, dtype=self.precision.grad_comm, device=flat.device)
        partial = self.main_grad

        def clear_partial() -> None:
            partial.zero_()

        send = self.axes.flat(flat, before)
        return send.redistribute(
            send.like(out, after), self.resources, stream, divisor=self.axes.outer_size,
            post_ops=[self._accumulate_op(out, self.reduced_grad, self._take_overwrite()), clear_partial],
        )

    def discard_partial_backward(self) -> None:
        """Forget gradients of an aborted backward that were never reduced."""
        self._backward = _BackwardGrads()
        # A reduction of the aborted backward may have written main_grad: the next one
        # looks at .grad again (zero_grad() since then makes it start over). From any phase.
        self.phase = GradPhase.IDLE
        self._overwrite = set()
        for p in self.fsdp_parameters:
            p.unsharded_param.grad = None

    def _grad_was_reset(self, p) -> bool:
        if self.precision_aware_grads and self.reduced_grad.dtype != self.precision.main_params:
            return getattr(p.sharded_param, "main_grad", None) is None
        return p.sharded_param.grad is None

    def _all_reduce_in_comm_dtype(self, buffer: torch.Tensor, before: str, after: str,
                                  divisor: float) -> comm.CollectiveWork:
        """Partial -> Replicate in place on ``buffer``, communicating in grad_comm_dtype."""
        comm_dtype, stream = self.precision.grad_comm, self.resources.reduce_scatter_stream
        if buffer.dtype == comm_dtype:
            wire = self.axes.flat(buffer, before)
            return wire.redistribute(wire.like(buffer, after), self.resources, stream, divisor=divisor)
        comm.follow_current_stream(self.device, stream)  # the buffer may have been written there
        with self.device.stream(stream):
            wire = self.axes.flat(buffer.to(comm_dtype), before)

        def copy_back() -> None:
            buffer.copy_(wire.data)

        return wire.redistribute(wire.like(wire.data, after), self.resources, stream, divisor=divisor,
                                 post_ops=[copy_back])

    def _take_grads_into(self, flat: torch.Tensor, accumulate: bool = False, scale: float = 1,
                         skip: frozenset = frozenset()) -> None:
        """Move each unsharded gradient into its place in a gathered-layout buffer.

        Copy mode fills an uninitialized buffer: every element is written once, by a
        gradient or, for shard padding and parameters without a gradient, by a zero.
        Parameters in ``skip`` were already stashed there by the gradient hook."""
        with torch.no_grad():
            if not accumulate:
                for offset, numel in self._padding_ranges:
                    flat.narrow(0, offset, numel).zero_()
            # no_shard accumulates into its reduced gradient itself: this is the reduction
            # that writes it, so it takes the parameters to restart from zero.
            restart_from_zero = self._take_overwrite() if accumulate and self.reduced_grad is self.main_grad else set()
            for p in self.fsdp_parameters:
                if p.index in skip:
                    continue
                grad = p.unsharded_param.grad
                pieces = self.layout.gathered_slices(flat, p.index)
                restart = p.index in restart_from_zero
                if grad is None or restart:
                    # no_shard restarts its reduced gradient (this very buffer) from zero.
                    for piece in pieces:
                        piece.zero_()
                if grad is None:
                    continue
                if accumulate:
                    for piece, src in zip(pieces, self.layout.source_chunks(grad, p.index)):
                        piece.add_(src, alpha=scale)
                else:
                    self.layout.copy_in(grad, flat, p.index)
                p.unsharded_param.grad = None

    def _accumulate_op(self, reduced: torch.Tensor, target: torch.Tensor, overwrite: set, scale: float = 1.0):
        """Post-op: add ``scale`` x a reduced shard into ``target``, first zeroing the slices
        of the parameters in ``overwrite`` (``target`` is then laid out like main_weight)."""
        zeroed = [p for p in self.fsdp_parameters if p.index in overwrite]

        def op() -> None:
            for p in zeroed:
                self.views.optim_view(target, p).zero_()
            target.add_(reduced.to(target.dtype), alpha=scale)

        return op

    def expose_grads(self) -> None:
        """Point each parameter's ``.grad`` at its reduced gradient (end of backward)."""
        if self.phase is GradPhase.REDUCED:
            self._set_phase(GradPhase.ACCUMULATING)
        if self.phase is not GradPhase.READY:
            return
        self._set_phase(GradPhase.IDLE)
        main_dtype = self.precision.main_params
        if self._grad_views is None:  # reduced_grad is persistent: build its DTensor views once
            self._grad_views = [
                self.views.dtensor(self.views.optim_view(self.reduced_grad, p), p, self.views.optimizer_placements(p))
                for p in self.fsdp_parameters
            ]
        for p, view in zip(self.fsdp_parameters, self._grad_views):
            # ``.main_grad`` is always the reduced gradient itself, in main_grads_dtype.
            p.sharded_param.main_grad = view
            if view.dtype == main_dtype:
                p.sharded_param.grad = view
            elif not self.precision_aware_grads:
                # torch optimizers need .grad in the parameter's dtype: a cast copy.
                p.sharded_param.grad = self.views.dtensor(view.to_local().to(main_dtype), p, self.views.optimizer_placements(p))
            # precision-aware optimizers read .main_grad; .grad stays unset.
