"""Hooking a plain ``torch.optim`` optimizer to the engine, and grad-norm clipping over shards.

After every ``step()`` the compute weights must be refreshed from the updated main weights
(a cast and, for ZeRO-1/2 and HFSDP, an all-gather). ``fully_shard_optimizer`` does it
through the optimizer's own step hooks, as upstream does. An optimizer built over sharded
parameters without it updates the model all the same: the next unshard sees the main
weights' version counter moved and refreshes first (weight_sync.py).
"""

from __future__ import annotations

from typing import Iterable, List

import torch


def _find_groups(optimizer: torch.optim.Optimizer, context=None):
    """The context owning the optimizer's parameters and their groups, or raise."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params:
        raise ValueError("The optimizer has no parameters; build it over model.parameters() after fully_shard.")
    contexts = []
    for p in params:
        ctx = getattr(p, "_mfsdp_context", None)
        if ctx is None:
            raise ValueError(
                "An optimizer parameter is not a sharded parameter of any FSDP unit (was the "
                "optimizer built before fully_shard, or over another model?). Build it over "
                "model.parameters() after the fully_shard_context scope exited."
            )
        if all(ctx is not c for c in contexts):
            contexts.append(ctx)
    if len(contexts) > 1:
        raise ValueError(
            "The optimizer holds parameters from two fully_shard_contexts; use one optimizer per context."
        )
    found = contexts[0]
    if context is not None and context is not found:
        raise ValueError(
            "The given context does not own the optimizer's parameters; pass the context the "
            "model was wrapped in (or omit context= to find it from the parameters)."
        )
    return found, _groups_in(params, found)


def _groups_in(params, context) -> List:
    """The parameter groups of ``context`` that own any of ``params``, in first-seen order."""
    groups, seen = [], set()
    for p in params:
        group = context.group_of(p)
        if group is not None and id(group) not in seen:
            seen.add(id(group))
            groups.append(group)
    return groups


def fully_shard_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    context=None,
    precision_aware: bool = False,
) -> torch.optim.Optimizer:
    """Hook ``optimizer`` (built over the sharded ``model.parameters()``) to the engine.

    After every ``step()`` (the optimizer's own step post-hook; ``step`` itself is not
    replaced) the compute weights are refreshed from the updated main weights, once per
    parameter group. An optimizer used without this still reaches the model: the next
    unshard refreshes first; this only does it eagerly, as upstream.

    Args:
        optimizer: a ``torch.optim.Optimizer`` whose parameters all belong to one context.
        context: that context; None finds it from the parameters (given, it is checked).
        precision_aware: leave ``.grad`` in ``main_grads_dtype`` (and unset where it
            differs from the parameters' dtype; ``.main_grad`` always holds it) for
            optimizers that handle mixed dtypes themselves.

    Returns:
        ``optimizer`` itself.

    Raises:
        ValueError: already hooked, no parameters, a parameter that is not a sharded
            parameter of any unit, parameters of two contexts, or a ``context`` that does
            not own them.
        RuntimeError: the context's scope has not been finalized.
        NotImplementedError (at ``step``): ``optimizer.step(closure)``.
    """
    if getattr(optimizer, "_mfsdp_context", None) is not None:
        raise ValueError("fully_shard_optimizer was already applied to this optimizer.")
    found, groups = _find_groups(optimizer, context)
    found.check_finalized()
    for group in groups:
        group.precision_aware_grads = bool(precision_aware)

    def refuse_closure(opt, args, kwargs):
        # ``args`` starts with the optimizer itself; a closure is its next argument.
        if kwargs.get("closure") is not None or (len(args) > 1 and args[1] is not None):
            raise NotImplementedError(
                "optimizer.step(closure) is not supported with MFSDP v2: run forward/backward "
                "yourself, then call optimizer.step()."
            )

    def sync_after_step(opt, args, kwargs):
        for group in groups:
            group.sync_model_weight_from_main_weight()

    optimizer.register_step_pre_hook(refuse_closure)
    optimizer.register_step_post_hook(sync_after_step)
    optimizer._mfsdp_context = found
    optimizer._mfsdp_groups = groups
    return optimizer


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm, computed over the sharded ``.grad`` DTensors.

    Equal to ``torch.nn.utils.clip_grad_norm_`` on an unsharded copy of the model: each
    rank sums its local shard, and the sum is reduced over the mesh axes that shard it
    (replicated axes are not counted twice). A non-finite norm leaves the gradients as
    they are. Returns the total norm (a float32 tensor). The project's one gradient-norm
    implementation (``megatron/core/optimizer/clip_grads.py``, which also knows the TP, EP
    and pipeline axes) does the work."""
    from megatron.core.optimizer.clip_grads import clip_grad_norm  # imports nothing of the engine

    return clip_grad_norm(list(parameters), max_norm, norm_type)
