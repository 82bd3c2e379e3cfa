"""Benchmark-only prototypes of proposed engine changes (the engine itself is not edited).

Each prototype is a modified copy of one engine method, installed on the *instances* of one
context's parameter groups, so a patched and an unpatched MFSDP model can run side by side
in one interleaved run (contender ``mfsdp_zero3+reduce_direct+cached_grads`` next to
``mfsdp_zero3``). ``apply(names)`` installs them on the classes instead (profile_step.py).

reduce_direct
    ``ParameterGroup.reduce_grads`` for reduce-scattered gradients (ZeRO-2/3, HSDP):
    * the gathered-layout input buffer is ``torch.empty`` and only the gaps no gradient
      covers (shard padding, parameters without a gradient) are zeroed, instead of
      ``torch.zeros`` over the whole buffer followed by copying every gradient over it;
    * when every gradient of the group starts fresh (the usual case: ``zero_grad()``
      set them to None) the reduce-scatter writes straight into ``main_grad`` and divides
      in place, instead of reducing into a new buffer, dividing it, zeroing the slices of
      ``main_grad`` and adding the result (three passes over the shard and an allocation);
    * otherwise (accumulation across microbatches) the division is folded into the
      accumulation: ``main_grad.add_(out, alpha=1/N)``.
cached_grads
    ``ParameterGroup.expose_grads`` builds the DTensor view of each reduced gradient once
    and reuses it every step (the reduced-gradient buffer is persistent), instead of a
    ``DTensor.from_local`` per parameter per step.
bounded_reduce
    ``FsdpContext._add_reductions``: the stock engine keeps every reduction of a backward in
    flight until the end-of-backward callback waits for them, and each keeps its input
    buffer (a gathered-layout copy of the unit's gradients) and its output shard alive
    until then: at the end of backward the buffers of *all* units coexist (~1.5 x the
    unsharded model in fp32 at N=2). The prototype completes the reductions issued two
    post-backwards earlier (FSDP2 does the same with the previous one), so at most two
    units' buffers are alive; their post-ops run then instead of at the end.
    ``bounded_reduce1`` completes the previous one (depth 1, FSDP2's rule). (On CUDA the
    same effect needs ``record_stream`` on the input at launch and dropping the reference.)
lazy_grads
    ``main_grad`` lives only from the first reduction of a step to ``zero_grad(set_to_none
    =True)`` (the optimizer's), like FSDP2's sharded gradients, instead of for the whole
    run: the forward and the first half of the backward run without it.
py_trims
    Per-call Python the hooks repeat: ``all_grads_received`` counts the trainable
    parameters once instead of on every gradient hook, and ``unshard`` computes the list
    of shard-spanning tensors once instead of on every all-gather.
"""

from __future__ import annotations

import collections
import types
from typing import Dict, List

import torch

from megatron.core.distributed.mfsdp_v2 import parameter_group as pg_mod
from megatron.core.distributed.mfsdp_v2 import work as comm

ORIGINAL = {
    "reduce_grads": pg_mod.ParameterGroup.reduce_grads,
    "expose_grads": pg_mod.ParameterGroup.expose_grads,
    "all_grads_received": pg_mod.ParameterGroup.all_grads_received,
    "unshard": pg_mod.ParameterGroup.unshard,
}


def _gaps(self) -> List[tuple]:
    """(offset, numel) of the shard padding in the gathered layout (cached per group)."""
    gaps = self.__dict__.get("_proto_gaps")
    if gaps is None:
        S = self.layout.shard_numel
        gaps = []
        for s in range(self.layout.num_shards):
            used = self.layout.used_numel(s)
            if used < S:
                gaps.append((s * S + used, S - used))
        self._proto_gaps = gaps
    return gaps


def reduce_grads_direct(self, is_last_microbatch: bool):
    strategy = self.strategy
    if not self.requires_grad or not strategy.grad_sharded or self.outer_layout is not None:
        return ORIGINAL["reduce_grads"](self, is_last_microbatch)  # ZeRO-1, no_shard, HFSDP: as before
    ctx, device = self.context, self.device
    self._received.clear()
    self.reduced_this_backward = True
    for p in self.fsdp_parameters:  # the engine's once-per-step bookkeeping, unchanged
        if self._fresh[p.index]:
            continue
        self._fresh[p.index] = True
        if self._grad_was_reset(p):
            self._overwrite[p.index] = True
        elif p.sharded_param.grad is not p.sharded_param.main_grad and p.sharded_param.grad is not None:
            with torch.no_grad():
                self._optim_view(self.reduced_grad, p).copy_(p.sharded_param.grad.to_local())
    divisor = self.inner_size * self.grad_divisor
    comm_dtype = self.precision.grad_comm
    flat = torch.empty(self.layout.gathered_numel, dtype=comm_dtype, device=self.main_weight.device)
    with torch.no_grad():
        for offset, numel in _gaps(self):
            flat.narrow(0, offset, numel).zero_()
        for p in self.fsdp_parameters:
            grad = p.unsharded_param.grad
            if grad is None:
                for piece in self.layout.gathered_slices(flat, p.index):
                    piece.zero_()
                continue
            self.layout.copy_in(grad, flat, p.index)
            p.unsharded_param.grad = None
    trainable = [p for p in self.fsdp_parameters if p.requires_grad]
    fresh = all(self._overwrite[p.index] for p in trainable)
    if self.main_grad is None:  # lazy_grads: released at zero_grad, allocated at the first reduction
        self.main_grad = torch.zeros(self.layout.shard_numel, dtype=self.precision.main_grads, device=flat.device) \
            if not fresh else torch.empty(self.layout.shard_numel, dtype=self.precision.main_grads, device=flat.device)
        self.reduced_grad = self.main_grad
        self.__dict__.get("_proto_grad_cache", {}).clear()
        if hasattr(self, "_grad_views"):
            self._grad_views = None
    if fresh and self.main_grad.dtype == comm_dtype:
        # Every slice is overwritten: reduce straight into the gradient shard.
        self._overwrite = [False] * len(self.fsdp_parameters)
        work = comm.reduce_scatter(self.main_grad, flat, self.inner_group, device=device,
                                   stream=ctx.reduce_scatter_stream, divisor=divisor, counter=ctx.counter)
    else:
        with device.stream(ctx.reduce_scatter_stream):
            out = torch.empty(self.layout.shard_numel, dtype=comm_dtype, device=flat.device)
        zeroed = [p for p in self.fsdp_parameters if self._overwrite[p.index]]
        self._overwrite = [False] * len(self.fsdp_parameters)
        target, scale = self.main_grad, 1.0 / divisor

        def accumulate() -> None:
            if fresh:  # every slice is overwritten: one pass, no zeroing
                torch.mul(out, scale, out=target)
                return
            for p in zeroed:
                self._optim_view(target, p).zero_()
            target.add_(out, alpha=scale)

        work = comm.reduce_scatter(out, flat, self.inner_group, device=device, stream=ctx.reduce_scatter_stream,
                                   post_ops=[accumulate], counter=ctx.counter)
    works = [work]
    if self.outer_group is not None and is_last_microbatch:
        works.append(self._outer_reduce(works[-1]))
    self._grads_reduced = self.outer_group is None or is_last_microbatch
    return works


def expose_grads_cached(self) -> None:
    if not self.requires_grad or not self._grads_reduced:
        return
    self._grads_reduced = False
    self._fresh = [False] * len(self.fsdp_parameters)
    cache: Dict[int, object] = self.__dict__.setdefault("_proto_grad_cache", {})
    main_dtype = self.precision.main_params
    for p in self.fsdp_parameters:
        grad = cache.get(p.index)
        if grad is None:
            grad = cache[p.index] = self._dtensor(self._optim_view(self.reduced_grad, p), p,
                                                  self._optimizer_placements(p))
        p.sharded_param.main_grad = grad
        if grad._local_tensor.dtype == main_dtype:
            p.sharded_param.grad = grad
        elif not self.context.precision_aware_grads:
            p.sharded_param.grad = self._dtensor(grad._local_tensor.to(main_dtype), p, self._optimizer_placements(p))


def all_grads_received_counted(self) -> bool:
    count = self.__dict__.get("_proto_trainable_count")
    if count is None:
        count = self._proto_trainable_count = sum(1 for p in self.fsdp_parameters if p.requires_grad)
    return len(self._received) == count


def unshard_cached_spanning(self):
    if self.is_unsharded:
        return None
    ctx, device = self.context, self.device
    stream = ctx.allgather_stream
    if device.is_cuda:
        stream.wait_stream(device.current_stream())
    self._unshard_versions = self._unsharded_tensors_and_versions()
    with device.stream(stream):
        pg_mod._alloc_storage(self.unsharded)
        for t in self._own_unsharded.values():
            pg_mod._alloc_storage(t)
    post_ops = self.__dict__.get("_proto_copy_out")
    if post_ops is None:
        spanning = [p for p in self.fsdp_parameters if not self.layout.is_contiguous_in_gathered(p.index)]

        def copy_out() -> None:
            for p in spanning:
                self.layout.copy_out(self.unsharded, p.index, self._own_unsharded[p.index])

        post_ops = self._proto_copy_out = [copy_out] if spanning else []
    self.is_unsharded = True
    return comm.all_gather(self.unsharded, self.model_weight, self.inner_group, device=device, stream=stream,
                           post_ops=post_ops, counter=ctx.counter)


PENDING_REDUCTIONS = 2  # reduction batches (one per parameter group) left in flight


def _engine_batches_reductions() -> bool:
    """Engine commit 8760f34 and later keep ``_pending_reductions`` as one list per unit
    and complete those issued MAX_REDUCTIONS_IN_FLIGHT units earlier."""
    from megatron.core.distributed.mfsdp_v2 import context as ctx_mod

    return hasattr(ctx_mod, "MAX_REDUCTIONS_IN_FLIGHT")


def add_reductions_bounded(self, works) -> None:
    depth = self.__dict__.get("_proto_pending_depth", PENDING_REDUCTIONS)
    if _engine_batches_reductions():
        if works:
            self._pending_reductions.append(list(works))
        while len(self._pending_reductions) > depth:
            for work in self._pending_reductions.pop(0):
                work.wait()
        return
    self._pending_reductions.extend(works)
    batches = self.__dict__.setdefault("_proto_batches", collections.deque())
    batches.append(list(works))
    completed = False
    while len(batches) > depth:
        for work in batches.popleft():
            work.wait()  # post-ops run here, in issue order; the input buffer is released
            completed = True
    if completed:  # drop finished works so their output buffers can go too
        self._pending_reductions = [w for w in self._pending_reductions if not w.is_completed()]


def settle_backward_bounded(self, per_group) -> None:
    type(self)._settle_backward(self, per_group)
    self.__dict__.get("_proto_batches", collections.deque()).clear()


CONTEXT_PATCHES = {
    "bounded_reduce": {"_add_reductions": add_reductions_bounded, "_settle_backward": settle_backward_bounded},
    # Depth 1: complete the previous unit's reduction when the next one is issued (FSDP2's rule).
    "bounded_reduce1": {"_add_reductions": add_reductions_bounded, "_settle_backward": settle_backward_bounded},
}
def _no_prefetch(self, unit) -> None:
    return None


# Not an optimization: measures what the forward prefetch costs in peak memory.
CONTEXT_PATCHES["no_fwd_prefetch"] = {"prefetch_forward": _no_prefetch}

CONTEXT_SETTINGS = {"bounded_reduce": {"_proto_pending_depth": 2}, "bounded_reduce1": {"_proto_pending_depth": 1}}

PATCHES = {
    "reduce_direct": {"reduce_grads": reduce_grads_direct},
    # lazy_grads needs a reduction that allocates main_grad when it was released.
    "lazy_grads": {"reduce_grads": reduce_grads_direct},
    "cached_grads": {"expose_grads": expose_grads_cached},
    "py_trims": {"all_grads_received": all_grads_received_counted, "unshard": unshard_cached_spanning},
}


def release_grads(ctx) -> None:
    """lazy_grads: drop every reference to the reduced-gradient buffers of a context."""
    for unit in ctx.units:
        for group in unit._fsdp_state.groups:
            if group.main_grad is None or group.main_grad is not group.reduced_grad or group.outer_layout is not None \
                    or not group.strategy.grad_sharded:
                continue
            group.main_grad = group.reduced_grad = None
            group.__dict__.get("_proto_grad_cache", {}).clear()
            if hasattr(group, "_grad_views"):
                group._grad_views = None  # the engine's cached views of the released buffer
            for p in group.fsdp_parameters:
                if getattr(p.sharded_param, "main_grad", None) is not None:
                    p.sharded_param.main_grad = None


def apply_to_optimizer(optimizer, ctx, names) -> None:
    """lazy_grads: release the gradient buffers when the optimizer sets .grad to None."""
    if "lazy_grads" not in names:
        return
    original = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True):
        original(set_to_none=set_to_none)
        if set_to_none:
            release_grads(ctx)

    optimizer.zero_grad = zero_grad


def already_in_engine(name: str) -> bool:
    """Prototypes the engine has adopted (commit 8760f34): installing them again would only
    replace the engine's version with the benchmark's copy."""
    import inspect

    from megatron.core.distributed.mfsdp_v2 import parameter_group as pg

    if name == "reduce_direct":
        return "self.main_grad, flat" in inspect.getsource(pg.ParameterGroup.reduce_grads)
    if name == "bounded_reduce":
        return _engine_batches_reductions()
    if name == "cached_grads":
        return "_grad_views" in inspect.getsource(pg.ParameterGroup.expose_grads)
    if name == "py_trims":
        return "_num_trainable" in inspect.getsource(pg.ParameterGroup.all_grads_received)
    return False


def _check(names) -> None:
    for name in names:
        if name not in PATCHES and name not in CONTEXT_PATCHES:
            raise ValueError(f"unknown prototype {name!r}; known: {sorted(PATCHES) + sorted(CONTEXT_PATCHES)}")


def apply_to_context(ctx, names) -> None:
    """Install the prototypes on one context and its parameter groups (instance methods)."""
    _check(names)
    names = [n for n in names if not already_in_engine(n)]
    for name in names:
        for method, fn in CONTEXT_PATCHES.get(name, {}).items():
            if method == "_settle_backward" and _engine_batches_reductions():
                continue  # the engine's own settle path already handles per-unit batches
            setattr(ctx, method, types.MethodType(fn, ctx))
        for attr, value in CONTEXT_SETTINGS.get(name, {}).items():
            setattr(ctx, attr, value)
    for unit in ctx.units:
        for group in unit._fsdp_state.groups:
            for name in names:
                for method, fn in PATCHES.get(name, {}).items():
                    setattr(group, method, types.MethodType(fn, group))


def apply(names) -> None:
    """Install the prototypes on the engine's classes (every context in the process)."""
    from megatron.core.distributed.mfsdp_v2 import context as ctx_mod

    _check(names)
    for name in names:
        for method, fn in PATCHES.get(name, {}).items():
            setattr(pg_mod.ParameterGroup, method, fn)
        for method, fn in CONTEXT_PATCHES.get(name, {}).items():
            if method == "_settle_backward":
                continue  # the class-level original is what settle_backward_bounded calls
            setattr(ctx_mod.FsdpContext, method, fn)
