"""The router: which experts each token goes to, with which weight, and the router losses.

Megatron-LM's ``TopKRouter`` semantics (``megatron/core/transformer/moe/router.py``):

* logits = x @ weight.T (+ bias) for ``weight`` [num_experts, hidden], in
  ``moe_router_dtype`` when set;
* softmax scoring: top-k of the logits then a softmax over those k (default), or with
  ``moe_router_pre_softmax`` the top-k of the softmax over all experts (not renormalised);
  sigmoid scoring: top-k of sigmoid(logits), renormalised to sum 1 when k > 1; both times
  ``moe_router_topk_scaling_factor``;
* with ``moe_expert_capacity_factor`` each expert keeps at most
  ``ceil(tokens * topk / num_experts * factor)`` tokens of this micro-batch (by probability,
  or by position), the rest are dropped (their weight is zero);
* the load-balancing loss (Switch Transformer):
  ``coeff * E / (k * T^2) * sum_e(tokens_e * sum_t score_te)`` over the T tokens of this
  micro-batch on this rank, with scores the softmax (sigmoid: normalised sigmoid) over all
  experts and tokens_e the top-k choices before dropping; the z-loss
  ``coeff * mean_t(logsumexp(logits_t)^2)``.

With sequence parallelism each TP rank routes its own chunk of the sequence, and its
losses are its chunk's share of the micro-batch's losses: the load-balancing loss with
the token counts and the number of tokens of the whole sequence (counts summed over TP),
the z-loss over the whole sequence's token count. The shares add up over TP to the
losses of the unsplit micro-batch, so no token is counted twice; ``last_stats`` holds
the whole values.

Neither loss is returned: as in Megatron, each is attached to the graph with
``MoEAuxLossAutoScaler`` so that backward adds its gradient with the scale the trainer
sets (``set_aux_loss_backward_scale``: 1/num_microbatches times the fp16 loss scale, the
factor the language-model loss gets), and the data-parallel gradient averaging then treats
it like the main loss.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..layers import normal_weight_zero_bias_

_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


# ---------------------------------------------------------------------------------------
# Routing math (functions of tensors, tested on their own)
# ---------------------------------------------------------------------------------------


def topk_routing_with_score_function(logits: torch.Tensor, topk: int, use_pre_softmax: bool = False,
                                     score_function: str = "softmax",
                                     scaling_factor: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(routing_probs [T, E], routing_map [T, E] bool): each token's k experts and weights."""
    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            probs, top_indices = torch.topk(scores, k=topk, dim=1)
        else:
            top_logits, top_indices = torch.topk(logits, k=topk, dim=1)
            probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores, top_indices = torch.topk(torch.sigmoid(logits.float()), k=topk, dim=1)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"unknown score function {score_function!r}; use softmax or sigmoid.")
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_probs, routing_map


def scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(routing_map, scores) the load-balancing loss uses: scores over all experts
    (softmax, or sigmoid normalised to sum 1) and their top-k, before any dropping."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, top_indices = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_map, scores


def switch_load_balancing_loss_func(probs: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: int,
                                    topk: int, num_experts: int, moe_aux_loss_coeff: float) -> torch.Tensor:
    """``coeff * E * sum_e f_e * P_e`` with f_e = tokens_e / (T k) (fraction of assignments)
    and P_e = sum_t probs_te / T (mean probability): equal to ``coeff`` when balanced."""
    aggregated = probs.sum(dim=0)
    return torch.sum(aggregated * tokens_per_expert) * (
        num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens))


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: ``coeff * mean(logsumexp(logits)^2)``."""
    return torch.mean(torch.square(torch.logsumexp(logits.float(), dim=-1))) * z_loss_coeff


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert keeps: ``ceil(num_tokens / num_experts * capacity_factor)``."""
    return math.ceil((num_tokens / num_experts) * capacity_factor)


def apply_router_token_dropping(routing_probs: torch.Tensor, routing_map: torch.Tensor, router_topk: int,
                                capacity_factor: float, drop_policy: str = "probs",
                                pad_to_capacity: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keep at most ``get_capacity(T * k, E, factor)`` tokens per expert.

    ``probs``: the tokens with the highest probability for that expert (ties: the earlier
    token); ``position``: the earliest tokens. With ``pad_to_capacity`` every expert gets
    exactly that many rows (tokens it was not chosen by come with weight zero)."""
    num_tokens, num_experts = routing_probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    if capacity >= num_tokens:
        capacity_mask = torch.ones_like(routing_map)
    else:
        if drop_policy == "probs":
            key = routing_probs.float()
        elif drop_policy == "position":
            key = routing_map.float()
        else:
            raise ValueError(f"unknown drop policy {drop_policy!r}; use probs or position.")
        # A stable descending sort breaks ties by position, so the result is deterministic.
        order = torch.sort(key, dim=0, descending=True, stable=True).indices[:capacity]
        capacity_mask = torch.zeros_like(routing_map).scatter(0, order, True)
    final_map = capacity_mask if pad_to_capacity else routing_map & capacity_mask
    return routing_probs * final_map, final_map


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output`` whose backward also sends ``scale`` as the gradient of
    ``aux_loss``: the loss joins the backward pass without being added to the model output."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


# ---------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------


class TopKRouter(nn.Module):
    """``weight`` [num_experts, hidden] (and ``bias`` with ``add_bias_linear``), Megatron's names.

    ``forward(x [T, H]) -> (probs [T, E], routing_map [T, E])``. In training with a backward
    to come, the aux and z losses are attached to the outputs. ``last_stats`` holds the last
    call's losses divided by their coefficients (what Megatron logs) and, with capacity
    dropping, the number of dropped (token, expert) assignments."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.init_std = config.init_method_std
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=config.params_dtype))
        self.bias = (nn.Parameter(torch.empty(self.num_experts, dtype=config.params_dtype))
                     if config.add_bias_linear else None)
        # Set by the trainer before each step (set_aux_loss_backward_scale).
        self.aux_loss_backward_scale = 1.0
        self.last_stats = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        normal_weight_zero_bias_(self)

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _ROUTER_DTYPES[self.config.moe_router_dtype] or x.dtype
        bias = self.bias.to(dtype) if self.bias is not None else None
        return F.linear(x.to(dtype), self.weight.to(dtype), bias)

    @property
    def sequence_group(self):
        """The TP group the sequence is split over (sequence parallelism), else None."""
        config = self.config
        if config.sequence_parallel and config.tensor_model_parallel_size > 1:
            return config.tp_group
        return None

    def _whole(self, share: torch.Tensor) -> torch.Tensor:
        """A loss of this rank's chunk summed over the sequence group (for logging)."""
        share = share.detach().clone()
        if self.sequence_group is not None:
            dist.all_reduce(share, group=self.sequence_group)
        return share

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        config = self.config
        logits = self.gating(x)
        with_losses = self.training and torch.is_grad_enabled()
        self.last_stats = {}
        group = self.sequence_group
        chunks = 1 if group is None else dist.get_world_size(group)
        if with_losses and config.moe_z_loss_coeff:
            z_loss = z_loss_func(logits, config.moe_z_loss_coeff) / chunks
            logits = MoEAuxLossAutoScaler.apply(logits, z_loss, self.aux_loss_backward_scale)
            self.last_stats["z_loss"] = self._whole(z_loss) / config.moe_z_loss_coeff
        probs, routing_map = topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=config.moe_router_pre_softmax,
            score_function=config.moe_router_score_function,
            scaling_factor=config.moe_router_topk_scaling_factor,
        )
        if config.moe_expert_capacity_factor is not None:
            chosen = routing_map
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, self.topk, config.moe_expert_capacity_factor,
                drop_policy=config.moe_token_drop_policy, pad_to_capacity=config.moe_pad_expert_input_to_capacity,
            )
            self.last_stats["dropped_tokens"] = (chosen & ~routing_map).sum().detach()
        coeff = config.moe_aux_loss_coeff
        if with_losses and coeff > 0 and config.moe_router_load_balancing_type == "aux_loss":
            aux_map, scores = scores_for_aux_loss(logits, self.topk, config.moe_router_score_function)
            tokens_per_expert = aux_map.sum(dim=0)
            if group is not None:  # the whole sequence's counts
                dist.all_reduce(tokens_per_expert, group=group)
            aux_loss = switch_load_balancing_loss_func(scores, tokens_per_expert, logits.shape[0] * chunks,
                                                       self.topk, self.num_experts, coeff)
            probs = MoEAuxLossAutoScaler.apply(probs, aux_loss, self.aux_loss_backward_scale)
            self.last_stats["load_balancing_loss"] = self._whole(aux_loss) / coeff
        return probs, routing_map


def set_aux_loss_backward_scale(model: nn.Module, scale: float) -> None:
    """The factor the router losses' gradients get in the next backward passes: the one the
    language-model loss of a micro-batch gets (1/num_microbatches, times the fp16 loss scale)."""
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.aux_loss_backward_scale = float(scale)
