"""The FsdpModule mixin and the per-unit state machine behind its hooks.

Lifecycle of one unit in a training step (ZeRO-3):

1. pre_forward: wait for this unit's all-gather (issue it if no prefetch did), swap in
   the unsharded parameters, prefetch the next unit in the static forward order.
2. post_forward: swap the sharded parameters back and free the unsharded storage; a root
   keeps its parameters for the backward that follows. Recomputation (activation
   checkpointing, detected as "forward while autograd runs a backward") neither
   prefetches nor reshards.
3. pre_backward (hook on the unit's outputs): unshard again, prefetch the next unit in
   backward order.
4. post_backward (all trainable parameters of the unit have their gradient, each already
   moved into the reduce buffer by its gradient hook): free the unsharded storage, then
   reduce-scatter into ``main_grad``.
5. end of backward (context callback): reduce any unit whose gradients never arrived,
   wait for all reductions, reshard everything, point ``.grad`` at the reduced shards.

The unsharded parameters are persistent ``nn.Parameter`` objects whose storage is
allocated at unshard and freed at reshard: autograd graphs built in forward (and the
graphs that non-reentrant checkpointing replays) keep referring to the same objects.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .work import CollectiveWork


def _in_backward() -> bool:
    # A forward that runs while the autograd engine executes a graph is a recomputation.
    return torch._C._current_graph_task_id() != -1


class _InputGradientHook(torch.autograd.Function):
    """Identity on the way forward; calls ``callback`` when the inputs' gradients exist."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads


def _on_input_gradients(callback, inputs):
    """Route the tensors of ``inputs`` that require grad through _InputGradientHook."""
    leaves, spec = tree_flatten(inputs)
    positions = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return inputs
    outputs = _InputGradientHook.apply(callback, *[leaves[i] for i in positions])
    if len(positions) == 1:
        outputs = (outputs,)
    for i, tensor in zip(positions, outputs):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)


class UnitState:
    """Runtime state of one FSDP unit."""

    def __init__(self, module: nn.Module, context, mesh, placements, strategy, groups, grad_divisor):
        self.module = module
        self.context = context
        self.mesh = mesh
        self.placements = placements
        self.strategy = strategy
        self.groups = groups
        self.trainable_groups = [g for g in groups if g.requires_grad]
        self.grad_divisor = grad_divisor
        self.name: Optional[str] = None
        self.forward_index = -1
        self.backward_index = -1
        self.pending_unshard: List[CollectiveWork] = []
        self.reduced_this_backward = False
        self.pre_backward_done = False

    # Unshard / reshard ------------------------------------------------------------------
    def issue_unshard(self) -> None:
        """Start the all-gathers of this unit (no-op when already unsharded or in flight)."""
        for group in self.groups:
            work = group.unshard()
            if work is not None:
                self.pending_unshard.append(work)

    def wait_pending_unshard(self) -> None:
        works, self.pending_unshard = self.pending_unshard, []
        for work in works:
            work.wait()

    def unshard(self) -> None:
        self.issue_unshard()
        self.wait_pending_unshard()
        for group in self.groups:
            group.use_unsharded()

    def reshard(self) -> None:
        for group in self.groups:
            group.reshard()

    # Hooks ------------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        self.context.check_finalized()
        recomputing = _in_backward()
        if not recomputing and self.context._backward_callback_queued:
            self.context._recover_from_aborted_backward()
        with self.context.device_handle.nvtx_range(f"mfsdp.pre_forward {self.name}"):
            self.unshard()
            if not recomputing:
                self.context.prefetch_forward(self.module)
        if not self.trainable_groups and self.groups and torch.is_grad_enabled():
            # A frozen unit has no gradient hook to tell when its backward is over: watch
            # the gradients flowing into its inputs instead, and reshard then.
            args, kwargs = _on_input_gradients(self._frozen_backward_done, (args, kwargs))
        return args, kwargs

    def _frozen_backward_done(self) -> None:
        self.reduced_this_backward = True  # nothing to reduce; keeps prefetch away too
        self.wait_pending_unshard()
        self.reshard()

    def post_forward(self, module, args, kwargs, output):
        recomputing = _in_backward()
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self._register_pre_backward_hooks(output)
        if recomputing:
            return output  # the backward that follows still needs the parameters
        if self.module in self.context.roots:
            if not grad_enabled:
                self.context.reshard_all()  # no backward will come: release everything
            return output
        self.reshard()
        return output

    def _register_pre_backward_hooks(self, output) -> None:
        tensors, _ = tree_flatten(output)
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(self._pre_backward)

    def _pre_backward(self, grad):
        context = self.context
        context._ensure_backward_callback()
        if not self.pre_backward_done:
            self.pre_backward_done = True
            with context.device_handle.nvtx_range(f"mfsdp.pre_backward {self.name}"):
                self.unshard()
                context.prefetch_backward(self.module)
        return grad

    def post_backward(self) -> None:
        context = self.context
        self.reduced_this_backward = True
        with context.device_handle.nvtx_range(f"mfsdp.post_backward {self.name}"):
            # Free the unsharded weights before the reduce buffers are filled and launched
            # (the gradients are separate tensors): the two never need to coexist.
            self.wait_pending_unshard()
            self.reshard()
            for group in self.trainable_groups:
                context._add_reductions(group.reduce_grads(context.is_last_microbatch))

    def init_parameters(self, init_fn) -> None:
        """Run an initializer on this unit's parameters in unsharded form and keep each
        rank's rows (the way to materialize a model built on the meta device)."""
        for group in self.groups:
            group.begin_init()
        for group in self.groups:
            group.use_unsharded()
        try:
            with torch.no_grad():
                if init_fn is not None:
                    init_fn(self.module)
                else:
                    for sub in _owned_submodules(self.module):
                        if hasattr(sub, "reset_parameters"):
                            sub.reset_parameters()
            for group in self.groups:
                group.end_init()
        finally:
            self.reshard()

    def reset_backward_state(self) -> None:
        self.reduced_this_backward = False
        self.pre_backward_done = False


def _owned_submodules(unit: nn.Module):
    """``unit`` and its submodules, without those that belong to nested units."""
    yield unit
    stack = list(unit.children())
    while stack:
        sub = stack.pop()
        if isinstance(sub, FsdpModule):
            continue
        yield sub
        stack.extend(sub.children())


class FsdpModule:
    """Mixin added to the class of every module passed to ``fully_shard``.

    The module keeps its identity (parents need no replacement); ``isinstance(m,
    FsdpModule)`` tells whether it is an FSDP unit.
    """

    _fsdp_state: UnitState

    @property
    def context(self):
        return self._fsdp_state.context

    @property
    def name(self) -> Optional[str]:
        """Name relative to its root ("" for a root), set when the scope exits."""
        return self._fsdp_state.name

    @property
    def parameter_groups(self):
        return self._fsdp_state.groups

    @property
    def placements(self):
        return self._fsdp_state.placements

    def is_root(self) -> bool:
        return self in self._fsdp_state.context.roots

    def unshard(self) -> None:
        """Gather this unit's parameters now (e.g. to inspect them outside forward)."""
        self._fsdp_state.context.check_finalized()
        self._fsdp_state.unshard()

    def reshard(self) -> None:
        self._fsdp_state.wait_pending_unshard()
        self._fsdp_state.reshard()

    def init_parameters(self, init_fn=None) -> None:
        """Initialize the parameters this unit owns, e.g. after building on ``meta``.

        Each owned parameter is made whole (unsharded) for the call, ``init_fn(module)``
        runs under ``torch.no_grad()`` (default: ``reset_parameters()`` of every owned
        submodule that has one), and each rank keeps its own rows. Only one unit is
        unsharded at a time, never the whole model. Every rank must use the same RNG
        state so that all ranks compute the same values. Parameters of nested units are
        still sharded DTensors during the call: initialize each unit (children first or
        in any order) with ``unit.init_parameters(...)``."""
        self._fsdp_state.wait_pending_unshard()
        self._fsdp_state.init_parameters(init_fn)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like ``nn.Module.zero_grad``; also resets ``.main_grad`` (read by
        precision-aware optimizers) of the parameters this unit owns."""
        super().zero_grad(set_to_none=set_to_none)
        units = [m for m in self.modules() if isinstance(m, FsdpModule)]
        for p in (p for unit in units for group in unit._fsdp_state.groups for p in group.fsdp_parameters):
            main_grad = getattr(p.sharded_param, "main_grad", None)
            if main_grad is not None and set_to_none:
                p.sharded_param.main_grad = None
            elif main_grad is not None:
                main_grad.to_local().zero_()

    def _apply(self, fn, recurse=True):
        raise RuntimeError(
            f"{type(self).__name__} is an FSDP unit: its parameters live in sharded flat buffers, so "
            "changing their dtype or device (model.to(...), .float(), .cuda(), ...) after "
            "fully_shard is not supported. Call model.to(...) before fully_shard, inside the scope."
        )

    def persistent_bytes(self) -> dict:
        total: dict = {}
        for group in self._fsdp_state.groups:
            for key, value in group.persistent_bytes().items():
                total[key] = total.get(key, 0) + value
        return total


_FSDP_CLASSES: dict = {}


def fsdp_class_for(cls: type) -> type:
    """The class ``cls`` with the FsdpModule mixin in front (one per original class)."""
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FsdpModule, cls), {"_fsdp_original_class": cls})
    return _FSDP_CLASSES[cls]
