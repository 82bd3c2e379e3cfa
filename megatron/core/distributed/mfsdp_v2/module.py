"""The FsdpModule mixin and the per-unit state machine behind its hooks.

Every unit has a ``phase`` (``FsdpModule.Phase``); all transitions go through one setter
that checks them (``phase.py``). Lifecycle of one unit in a training
step (ZeRO-3):

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
   Frozen parameters of the unit stay gathered until the gradients of the unit's inputs
   exist (its backward is really over), or until the end of backward.
5. end of backward (backward.py): reduce any unit whose gradients never arrived, wait
   for all reductions, reshard everything, point ``.grad`` at the reduced shards.

A root set to ``set_reshard_after_forward(False)`` (a pipeline chunk under
``--megatron-fsdp-no-reshard-after-forward``) skips the reshards of steps 2, 4 and 5 for
all its units until its last microbatch's backward: one gather per unit and step.

The unsharded parameters are persistent ``nn.Parameter`` objects whose storage is
allocated at unshard and freed at reshard: autograd graphs built in forward (and the
graphs that non-reentrant checkpointing replays) keep referring to the same objects.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn

from megatron.core.torch_private import current_graph_task_id, in_backward, tree_flatten, tree_unflatten

from .phase import Phase, check_transition
from .profiling import hook_range, unit_label
from .work import CollectiveWork


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
    """Route the tensors of ``inputs`` that require grad through _InputGradientHook.

    Returns ``(inputs, hooked)``; nothing is hooked when no input requires grad."""
    leaves, spec = tree_flatten(inputs)
    positions = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return inputs, False
    outputs = _InputGradientHook.apply(callback, *[leaves[i] for i in positions])
    if len(positions) == 1:
        outputs = (outputs,)
    for i, tensor in zip(positions, outputs):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec), True


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
        self.frozen_groups = [g for g in groups if not g.requires_grad]
        self.grad_divisor = grad_divisor
        self.name: Optional[str] = None
        self.is_root = False
        self.root: Optional["UnitState"] = None  # the root unit whose tree holds this one (set at scope exit)
        # Read on roots only: whether the microbatch running now is the root's last of the
        # step (microbatch(context, is_last, module=root)); every unit below reads its root's.
        self.is_last_microbatch = True
        # Read on roots only (FsdpModule.set_reshard_after_forward): False keeps every unit
        # of the root gathered from its first forward to its last microbatch's backward.
        self.reshard_after_forward = True
        self.forward_index = -1
        self.backward_index = -1
        self.pending_unshard: List[CollectiveWork] = []
        self._phase = Phase.RESTING
        # Forward calls whose input gradients have not come back yet: frozen groups stay
        # gathered until then (a unit called twice needs them for both backwards).
        self._input_grads_pending = 0
        self._backward_task: Optional[int] = None  # the autograd graph task this unit's backward began in
        self.set_name(None)
        for group in self.trainable_groups:
            group.on_grad_ready = self._on_grad_ready

    def set_name(self, name: Optional[str]) -> None:
        self.name = name
        label = unit_label(name)
        self.range_names = {hook: f"MFSDP {label} {hook}" for hook in
                            ("pre_forward", "post_forward", "pre_backward", "post_backward")}

    # Lifecycle ----------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._phase

    @phase.setter
    def phase(self, new: Phase) -> None:
        check_transition(unit_label(self.name), self._phase, new)
        self._phase = new

    def rest(self) -> None:
        """End of a backward (finished or aborted): back to RESTING from any phase."""
        self._phase = Phase.RESTING
        self._input_grads_pending = 0
        self._backward_task = None

    # Unshard / reshard ------------------------------------------------------------------
    def issue_unshard(self) -> None:
        """Start the all-gathers of this unit (no-op when already unsharded or in flight)."""
        for group in self.groups:
            group.sync_if_main_weight_changed()  # main weights changed by other means than fully_shard_optimizer
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

    def reshard(self, groups=None) -> None:
        for group in self.groups if groups is None else groups:
            group.reshard()

    def keeps_gathered(self) -> bool:
        """After a backward: whether this unit stays gathered for its root's next microbatch."""
        return not self.root.reshard_after_forward and not self.root.is_last_microbatch

    # Hooks ------------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        context = self.context
        context.check_finalized()
        recomputing = in_backward()
        if not recomputing:
            if context.backward.callback_queued:
                context.backward.recover_from_aborted_backward()
            if self._phase is Phase.FORWARD:
                self.rest()  # an earlier forward of this unit raised before post_forward
        with hook_range(self.range_names["pre_forward"], context.device_handle):
            if self._phase is Phase.RESTING:
                self.phase = Phase.FORWARD  # a recomputation inside BACKWARD keeps BACKWARD
            self.unshard()
            if not recomputing:
                context.prefetch_forward(self)
        non_reentrant_recompute = recomputing and self._phase is not Phase.FORWARD
        if self.frozen_groups and torch.is_grad_enabled() and not non_reentrant_recompute:
            # Frozen parameters have no gradient hook to tell when the unit's backward no
            # longer needs them: watch the gradients flowing into its inputs instead.
            (args, kwargs), hooked = _on_input_gradients(self._input_gradients_done, (args, kwargs))
            self._input_grads_pending += int(hooked)
        return args, kwargs

    def _input_gradients_done(self) -> None:
        self._input_grads_pending -= 1
        if self._input_grads_pending > 0:
            return
        if not self.trainable_groups and self._phase is not Phase.POST_BACKWARD:
            self.phase = Phase.POST_BACKWARD  # nothing to reduce; keeps prefetch away too
        self.wait_pending_unshard()
        if not self.keeps_gathered():
            self.reshard(self.frozen_groups)

    def post_forward(self, module, args, kwargs, output):
        recomputing = in_backward()
        grad_enabled = torch.is_grad_enabled()
        with hook_range(self.range_names["post_forward"], self.context.device_handle):
            if grad_enabled:
                self._register_pre_backward_hooks(output)
            if self._phase is Phase.FORWARD:
                self.phase = Phase.RESTING
            if recomputing:
                return output  # the backward that follows still needs the parameters
            if self.is_root:
                if not grad_enabled:
                    self.context.reshard_all()  # no backward will come: release everything
                return output
            if grad_enabled and not self.root.reshard_after_forward:
                return output  # kept until the root's last microbatch's backward
            self.reshard()
        return output

    def _register_pre_backward_hooks(self, output) -> None:
        tensors, _ = tree_flatten(output)
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(self._pre_backward)

    def _pre_backward(self, grad):
        context = self.context
        context.backward.ensure_final_callback(self)
        context.backward.run_deferred_post_backwards(moving_on_from=self)
        if self._phase is not Phase.RESTING:
            return grad  # another output of this unit already started its backward
        with hook_range(self.range_names["pre_backward"], context.device_handle):
            self.phase = Phase.BACKWARD
            self._backward_task = current_graph_task_id()
            self.unshard()
            context.prefetch_backward(self)
        return grad

    def _on_grad_ready(self) -> None:
        """A trainable parameter's gradient was accumulated (called by its group)."""
        self.context.backward.ensure_final_callback(self)
        if self._phase is not Phase.POST_BACKWARD and all(g.all_grads_received() for g in self.trainable_groups):
            if self._backward_task is not None and current_graph_task_id() != self._backward_task:
                # A graph nested in this unit's backward (a reentrant checkpoint inside the
                # unit) delivered the last gradient; the unit's own graph may still use the
                # parameters and add to their gradients. Reduce once that graph moves on.
                self.context.backward.defer_post_backward(self)
                return
            self.post_backward()

    def reduce_if_pending(self) -> None:
        """End of backward: a unit whose gradients never (all) came reduces now."""
        if self.trainable_groups and self._phase is not Phase.POST_BACKWARD:
            self.post_backward()

    def post_backward(self) -> None:
        context = self.context
        self.phase = Phase.POST_BACKWARD
        with hook_range(self.range_names["post_backward"], context.device_handle):
            # Free the unsharded weights before the reduce buffers are filled and launched
            # (the gradients are separate tensors): the two never need to coexist. Frozen
            # groups may still be needed by the rest of this unit's backward.
            self.wait_pending_unshard()
            if not self.keeps_gathered():
                self.reshard(self.trainable_groups)
            for group in self.trainable_groups:
                context.backward.add_reductions(group.reduce_grads(self.root.is_last_microbatch))

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

    Phase = Phase
    _fsdp_state: UnitState

    @property
    def fsdp_state(self) -> UnitState:
        """The engine's state of this unit (its groups, phase, prefetch indices): what the
        context, the backward coordinator and the checkpoint adapter drive."""
        return self._fsdp_state

    @property
    def phase(self) -> Phase:
        """This unit's lifecycle phase (RESTING between steps)."""
        return self._fsdp_state.phase

    @property
    def context(self):
        return self._fsdp_state.context

    @property
    def name(self) -> Optional[str]:
        """Name relative to its root ("" for a root), set when the scope exits."""
        return self._fsdp_state.name

    @property
    def parameter_groups(self) -> tuple:
        return tuple(self._fsdp_state.groups)

    @property
    def placements(self):
        return self._fsdp_state.placements

    def is_root(self) -> bool:
        return self._fsdp_state.is_root

    def unshard(self) -> None:
        """Gather this unit's parameters now (e.g. to inspect them outside forward)."""
        self._fsdp_state.context.check_finalized()
        self._fsdp_state.unshard()

    def reshard(self) -> None:
        self._fsdp_state.wait_pending_unshard()
        self._fsdp_state.reshard()

    def set_reshard_after_forward(self, value: bool) -> None:
        """On a root (e.g. one pipeline chunk): True (the default) frees each unit's
        gathered parameters after its forward and again after its backward, gathering them
        anew for every microbatch (ZeRO-3). False keeps every unit of this root gathered from
        its first forward until the backward of the root's last microbatch
        (``microbatch(ctx, is_last=True, module=root)``; outside a microbatch scope every
        backward is the last): fewer all-gathers, the whole root's parameters in memory."""
        if not self._fsdp_state.is_root:
            raise ValueError(f"set_reshard_after_forward applies to a root of the context (a whole model chunk); "
                             f"{type(self).__name__} {self.name!r} is inside another unit: call it on that root.")
        self._fsdp_state.reshard_after_forward = bool(value)

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
        """``model.to(...)`` and friends: move everything but this unit's parameters.

        The unit's parameters live in flat buffers on the context's device: a conversion
        that would change their dtype or device raises; one that would not (e.g.
        ``model.to(device)`` after sharding a child on that device) leaves them alone and
        applies to buffers, unwrapped submodules and nested units as usual."""
        state = self._fsdp_state
        kinds = {(g.main_weight.dtype, g.main_weight.device) for g in state.groups}
        kinds |= {(g.dtype, g.main_weight.device) for g in state.groups}
        for dtype, device in kinds:
            probe = fn(torch.empty(0, dtype=dtype, device=device))
            if probe.dtype != dtype or probe.device != device:
                raise RuntimeError(
                    f"{type(self).__name__} is an FSDP unit: its parameters live in sharded flat buffers "
                    f"({dtype} on {device}), so changing their dtype or device (model.to(...), .float(), "
                    ".cuda(), ...) after fully_shard is not supported. Call model.to(...) before fully_shard, "
                    "inside the scope."
                )
        slots = [(module, attr) for group in state.groups for p in group.fsdp_parameters for module, attr in p.slots]
        saved = [(module, attr, module._parameters[attr]) for module, attr in slots]
        for module, attr, _ in saved:
            module._parameters[attr] = None  # nn.Module._apply skips None entries
        try:
            super()._apply(fn, recurse)
        finally:
            for module, attr, param in saved:
                module._parameters[attr] = param
        return self

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
