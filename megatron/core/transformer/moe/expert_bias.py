"""Aux-loss-free load balancing (DeepSeek-V3): the per-expert bias of the routers and its update.

A router with ``moe_router_enable_expert_bias`` adds ``expert_bias`` to its scores for the
choice of experts only, and counts the assignments of every training forward
(``local_tokens_per_expert``, router.py). After each optimizer step the bias moves by
``moe_router_bias_update_rate`` towards balance (``expert_bias_update``) from the counts
summed over the data-parallel ranks, and the counts restart: the training loop calls
``update_expert_biases(model)`` after each step it takes (docs/design.md, "The expert bias").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .router import TopKRouter


def expert_bias_update(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free rule: ``bias + rate * sign(mean_e tokens - tokens_e)`` (the
    last dimension is the experts): under-loaded experts go up, over-loaded ones down."""
    mean = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return expert_bias + torch.sign(mean - tokens_per_expert) * rate


def update_expert_biases(model: nn.Module) -> None:
    """Apply ``expert_bias_update`` to every router of ``model`` with an expert bias, in
    training mode, from the token counts since the last update summed over the
    data-parallel ranks (and the sequence-parallel TP group), then zero the counts. A
    collective over those ranks: every rank calls it, once per optimizer step taken (a
    skipped step leaves its counts to the next)."""
    _update_biases([m for m in model.modules() if isinstance(m, TopKRouter)])


def _update_biases(routers) -> None:
    routers = [r for r in routers if r.expert_bias is not None and r.training]
    by_groups = {}
    for router in routers:  # one all-reduce per set of groups, layers stacked
        groups = router.data_parallel_groups + ((router.sequence_group,) if router.sequence_group else ())
        by_groups.setdefault(tuple(id(g) for g in groups), (groups, []))[1].append(router)
    with torch.no_grad():
        for groups, members in by_groups.values():
            counts = torch.stack([r.local_tokens_per_expert.to(r.expert_bias.device) for r in members])
            for group in groups:
                dist.all_reduce(counts, group=group)
            for router, row in zip(members, counts):
                router.expert_bias.copy_(expert_bias_update(row, router.expert_bias,
                                                            router.config.moe_router_bias_update_rate))
                router.local_tokens_per_expert = torch.zeros_like(router.expert_bias)

