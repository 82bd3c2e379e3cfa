"""A group's gradients: from autograd's unsharded ``.grad`` to the reduced ``.grad`` the
optimizer reads.

``GradientReduction`` is a mixin of ``ParameterGroup``: the stash of each gradient into
the reduce-scatter input as it arrives, the reduction into ``main_grad`` (reduce-scatter,
all-reduce, the outer-axis reduction of HSDP/HFSDP on the last microbatch), and exposing
``.grad``/``.main_grad`` at the end of backward. It uses the group's layouts and views
(``shard_views.py``), buffers (``main_grad``, ``reduced_grad``), ``precision``, process
groups and ``resources`` (streams, counter).
"""

from __future__ import annotations

from typing import List

import torch

from . import work as comm


class GradientReduction:
    """Reduction of one group's gradients into ``main_grad``."""

    def all_grads_received(self) -> bool:
        return len(self._received) == self._num_trainable

    def _stash_grad(self, p) -> None:
        """Move ``p``'s fresh unsharded gradient into the pending reduce-scatter input."""
        grad = p.unsharded_param.grad
        if grad is None:
            return
        with torch.no_grad():
            if self._reduce_input is None:
                self._reduce_input = torch.empty(
                    self.layout.gathered_numel, dtype=self.precision.grad_comm, device=self.main_grad.device
                )
            if p.index in self._stashed:  # a second gradient in this backward (reentrant graphs)
                for piece, src in zip(self.layout.gathered_slices(self._reduce_input, p.index),
                                      self.layout.source_chunks(grad, p.index)):
                    piece.add_(src)
            else:
                self.layout.copy_in(grad, self._reduce_input, p.index)
                self._stashed.add(p.index)
        p.unsharded_param.grad = None

    def reduce_grads(self, is_last_microbatch: bool) -> List[comm.CollectiveWork]:
        """Reduce this backward's gradients into main_grad (missing gradients count as zero)."""
        if not self.requires_grad:
            return []
        ctx, device, strategy = self.resources, self.device, self.strategy
        self._received.clear()
        for p in self.fsdp_parameters:
            # Once per step (the first reduction after .grad was exposed): a parameter whose
            # .grad was set to None starts a fresh accumulation; a .grad that is a cast copy
            # (mixed precision) may have been changed in place (zero_grad(set_to_none=False),
            # clipping), so its values become the base of the accumulation.
            if self._fresh[p.index]:
                continue
            self._fresh[p.index] = True
            if self._grad_was_reset(p):
                self._overwrite[p.index] = True
            elif p.sharded_param.grad is not p.sharded_param.main_grad and p.sharded_param.grad is not None:
                with torch.no_grad():
                    self._optim_view(self.reduced_grad, p).copy_(p.sharded_param.grad.to_local())
        divisor = self.inner_size * self.grad_divisor
        works: List[comm.CollectiveWork] = []
        if strategy.grad_sharded:
            comm_dtype = self.precision.grad_comm
            flat, self._reduce_input = self._reduce_input, None
            if flat is None:
                flat = torch.empty(self.layout.gathered_numel, dtype=comm_dtype, device=self.main_grad.device)
            self._take_grads_into(flat, skip=self._stashed)
            self._stashed = set()
            # HFSDP accumulates a local partial sum here and reduces it on the outer axis
            # later; every other strategy accumulates straight into the reduced gradient.
            direct = self.main_grad is self.reduced_grad
            trainable = [p for p in self.fsdp_parameters if p.requires_grad]
            if direct and comm_dtype == self.main_grad.dtype and all(self._overwrite[p.index] for p in trainable):
                # Every slice starts fresh (the usual step after zero_grad()): reduce straight
                # into main_grad, with no extra buffer and no accumulate pass.
                self._overwrite = [False] * len(self.fsdp_parameters)
                works.append(comm.reduce_scatter(
                    self.main_grad, flat, self.inner_group, device=device, stream=ctx.reduce_scatter_stream,
                    divisor=divisor, counter=ctx.counter,
                ))
            else:
                with device.stream(ctx.reduce_scatter_stream):
                    out = torch.empty(self.layout.shard_numel, dtype=comm_dtype, device=flat.device)
                works.append(comm.reduce_scatter(
                    out, flat, self.inner_group, device=device, stream=ctx.reduce_scatter_stream,
                    post_ops=[self._accumulate_op(out, self.main_grad, overwrite=direct, scale=1 / divisor)],
                    counter=ctx.counter,
                ))
            if self.outer_group is not None and is_last_microbatch:
                works.append(self._outer_reduce(works[-1]))
            self._grads_reduced = self.outer_group is None or is_last_microbatch
            return works
        # Replicated gradients (no_shard, ZeRO-1): accumulate locally, reduce on the last microbatch.
        # no_shard reduces in place, on top of what earlier backwards already reduced, and the
        # all-reduce divides the whole buffer: so grad_divisor is applied to the new local
        # gradients here and the all-reduce divides by the rank count only.
        in_place = not strategy.optim_sharded
        self._take_grads_into(self.main_grad, accumulate=True, scale=1 / self.grad_divisor if in_place else 1)
        if not is_last_microbatch:
            return works
        if strategy.optim_sharded:  # ZeRO-1: reduce-scatter the local sum into the shard
            comm_dtype = self.precision.grad_comm
            comm.follow_current_stream(device, ctx.reduce_scatter_stream)  # main_grad was written there
            with device.stream(ctx.reduce_scatter_stream):
                out = torch.empty(self.layout.shard_numel, dtype=comm_dtype, device=self.main_grad.device)
                send = self.main_grad.to(comm_dtype)
            local = self.main_grad

            def clear_local() -> None:
                local.zero_()

            works.append(comm.reduce_scatter(
                out, send, self.inner_group, device=device, stream=ctx.reduce_scatter_stream, divisor=divisor,
                post_ops=[self._accumulate_op(out, self.reduced_grad, overwrite=True), clear_local],
                counter=ctx.counter,
            ))
        else:  # no_shard: all-reduce in place. Content left from earlier steps is identical on
            # every rank, so SUM / N returns it unchanged and new gradients are averaged onto it.
            works.append(self._all_reduce_in_comm_dtype(self.main_grad, self.inner_group, self.inner_size))
        if self.outer_group is not None:
            works.append(self._outer_reduce(works[-1]))
        self._grads_reduced = True
        return works

    def _outer_reduce(self, inner_work: comm.CollectiveWork) -> comm.CollectiveWork:
        """Last microbatch: reduce over the outer axis (all-reduce for HSDP, reduce-scatter
        of the inner shard for HFSDP)."""
        ctx, stream = self.resources, self.resources.reduce_scatter_stream
        # The outer reduction reads what the inner one wrote: order them (stream-ordered
        # on CUDA; on CPU this completes the inner reduction first).
        with self.device.stream(stream):
            inner_work.wait()
        if self.outer_layout is None:
            # In place: content left from earlier steps is identical on every outer rank,
            # so SUM / M keeps it and averages the new gradients onto it.
            return self._all_reduce_in_comm_dtype(self.reduced_grad, self.outer_group, self.outer_size)
        with self.device.stream(stream):
            flat = torch.zeros(self.outer_layout.gathered_numel, dtype=self.precision.grad_comm, device=self.main_grad.device)
            for piece_index, piece in enumerate(self.layout.pieces_by_shard[self.shard_index]):
                local = self.main_grad.narrow(0, piece.offset, piece.numel)
                self.outer_layout.copy_in(local, flat, piece_index)
            out = torch.empty(self.outer_layout.shard_numel, dtype=self.precision.grad_comm, device=flat.device)
        partial = self.main_grad

        def clear_partial() -> None:
            partial.zero_()

        return comm.reduce_scatter(
            out, flat, self.outer_group, device=self.device, stream=stream, divisor=self.outer_size,
            post_ops=[self._accumulate_op(out, self.reduced_grad, overwrite=True), clear_partial], counter=ctx.counter,
        )

    def discard_partial_backward(self) -> None:
        """Forget gradients of an aborted backward that were never reduced."""
        self._received.clear()
        self._reduce_input, self._stashed = None, set()
        for p in self.fsdp_parameters:
            p.unsharded_param.grad = None

    def _grad_was_reset(self, p) -> bool:
        if self.precision_aware_grads and self.reduced_grad.dtype != self.precision.main_params:
            return getattr(p.sharded_param, "main_grad", None) is None
        return p.sharded_param.grad is None

    def _all_reduce_in_comm_dtype(self, buffer: torch.Tensor, group, divisor: float) -> comm.CollectiveWork:
        """All-reduce ``buffer`` in place, communicating in grad_comm_dtype."""
        comm_dtype, stream = self.precision.grad_comm, self.resources.reduce_scatter_stream
        if buffer.dtype == comm_dtype:
            return comm.all_reduce(
                buffer, group, device=self.device, stream=stream, divisor=divisor, counter=self.resources.counter
            )
        comm.follow_current_stream(self.device, stream)  # the buffer may have been written there
        with self.device.stream(stream):
            wire = buffer.to(comm_dtype)

        def copy_back() -> None:
            buffer.copy_(wire)

        return comm.all_reduce(
            wire, group, device=self.device, stream=stream, divisor=divisor, post_ops=[copy_back],
            counter=self.resources.counter,
        )

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
            for p in self.fsdp_parameters:
                if p.index in skip:
                    continue
                grad = p.unsharded_param.grad
                pieces = self.layout.gathered_slices(flat, p.index)
                restart = accumulate and self._overwrite[p.index] and self.reduced_grad is self.main_grad
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
        if accumulate and self.reduced_grad is self.main_grad:
            self._overwrite = [False] * len(self.fsdp_parameters)

    def _accumulate_op(self, reduced: torch.Tensor, target: torch.Tensor, overwrite: bool, scale: float = 1.0):
        """Post-op: add ``scale`` x a reduced shard into ``target``; with ``overwrite``, first
        zero the slices of parameters whose gradient was reset (``target`` is then laid out
        like main_weight)."""
        zeroed = []
        if overwrite:
            zeroed = [p for p in self.fsdp_parameters if self._overwrite[p.index]]
            self._overwrite = [False] * len(self.fsdp_parameters)

        def op() -> None:
            for p in zeroed:
                self._optim_view(target, p).zero_()
            target.add_(reduced.to(target.dtype), alpha=scale)

        return op

    def expose_grads(self) -> None:
        """Point each parameter's ``.grad`` at its reduced gradient (end of backward)."""
        if not self.requires_grad or not self._grads_reduced:
            return
        self._grads_reduced = False
        self._fresh = [False] * len(self.fsdp_parameters)
        main_dtype = self.precision.main_params
        if self._grad_views is None:  # reduced_grad is persistent: build its DTensor views once
            self._grad_views = [
                self._dtensor(self._optim_view(self.reduced_grad, p), p, self._optimizer_placements(p))
                for p in self.fsdp_parameters
            ]
        for p, view in zip(self.fsdp_parameters, self._grad_views):
            # ``.main_grad`` is always the reduced gradient itself, in main_grads_dtype.
            p.sharded_param.main_grad = view
            if view.dtype == main_dtype:
                p.sharded_param.grad = view
            elif not self.precision_aware_grads:
                # torch optimizers need .grad in the parameter's dtype: a cast copy.
                p.sharded_param.grad = self._dtensor(view.to_local().to(main_dtype), p, self._optimizer_placements(p))
            # precision-aware optimizers read .main_grad; .grad stays unset.
