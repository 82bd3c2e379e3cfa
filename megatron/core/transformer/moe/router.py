"""The router: which experts each token goes to, with which weight, and the router losses.

Megatron-LM's ``TopKRouter`` semantics (``megatron/core/transformer/moe/router.py`` and
``moe_utils.py``):

* logits = x @ weight.T (+ bias) for ``weight`` [num_experts, hidden], in
  ``moe_router_dtype`` when set;
* softmax scoring: top-k of the logits then a softmax over those k (default), or with
  ``moe_router_pre_softmax`` the top-k of the softmax over all experts (not renormalised);
  sigmoid scoring: top-k of sigmoid(logits), renormalised to sum 1 when k > 1; both times
  ``moe_router_topk_scaling_factor``;
* group-limited routing (``moe_router_num_groups`` / ``moe_router_group_topk``, DeepSeek-V2/V3):
  the experts form equal groups, each token keeps the ``group_topk`` groups whose best
  ``topk / group_topk`` scores sum highest, and picks its k experts among those;
* aux-loss-free balancing (``moe_router_enable_expert_bias``, DeepSeek-V3, sigmoid only): a
  per-expert ``expert_bias`` buffer is added to the scores for the choice of the k experts
  only (the weights are the unbiased scores); after each optimizer step it moves by
  ``moe_router_bias_update_rate`` towards balance, ``bias_e += rate * sign(mean - tokens_e)``
  with tokens_e the step's assignments summed over the data-parallel ranks
  (``expert_bias.py``);
* ``sinkhorn`` balancing (S-BASE): in training the k experts are the top-k of the Sinkhorn
  normalisation of exp(logits) over the micro-batch's tokens (under CP and sequence
  parallelism every chunk's: the column sums are all-reduced), the weights sigmoid(logits) (k = 1)
  or the softmax over all experts, unnormalised; in evaluation the top-k of those weights;
* with ``moe_expert_capacity_factor`` each expert keeps at most
  ``ceil(tokens * topk / num_experts * factor)`` of the tokens the router sees (by
  probability, or by position), the rest are dropped (their weight is zero). Those are the
  micro-batch's on this rank: under sequence parallelism this TP rank's chunk, as upstream
  (its router runs on the chunk), so capacity and drops are per chunk; the logged count of
  dropped assignments is summed over the chunks.

The losses (``moe_router_load_balancing_type``: one type, or a list with one
``moe_aux_loss_coeff`` each), with scores p the softmax (sigmoid: normalised sigmoid) over
all experts and tokens_e the top-k choices of p before dropping:

* ``aux_loss`` (Switch Transformer), over the T tokens of this micro-batch on this rank:
  ``coeff * E / (k * T^2) * sum_e(tokens_e * sum_t p_te)``;
* ``seq_aux_loss`` (DeepSeek-V2/V3), the same per sequence of S tokens, averaged over the
  micro-batch's sequences;
* ``global_aux_loss``: tokens_e summed over the data-parallel ranks and averaged over the
  step's micro-batches so far, T the micro-batch's tokens of all data-parallel ranks; each
  rank's loss is its tokens' share (Megatron's definition);
* the z-loss ``coeff * mean_t(logsumexp(logits_t)^2)``.

With sequence parallelism each TP rank routes its own chunk of the sequence, and its
losses are its chunk's share of the micro-batch's losses: the token counts and numbers are
those of the whole sequences (counts summed over TP), the z-loss over the whole sequence's
token count. The shares add up over TP to the losses of the unsplit micro-batch, so no
token is counted twice; ``last_stats`` holds the whole values. The data-parallel ranks are
the ranks of the expert-parallel mesh of this TP coordinate (``data_parallel_groups``).

Context parallelism splits every sequence over the CP group the same way (each CP rank
routes its 2 chunks): the counts of ``aux_loss`` and ``seq_aux_loss`` are summed over CP
as well, T and S are the whole sequences', the z-loss is divided by the CP size too, and
each rank's loss is its tokens' share. The expert mesh counts CP ranks as data-parallel
ranks (``parallel_state`` folds them in), so ``global_aux_loss`` and the expert bias sum
over them through ``data_parallel_groups``. One difference from TP: gradients are
averaged over CP (the engine treats CP ranks as data-parallel), not summed, so the shares'
backward gets the factor CP, as the trainer gives the language-model loss.

Neither loss is returned: as in Megatron, each is attached to the graph with
``MoEAuxLossAutoScaler`` so that backward adds its gradient with the scale the trainer
sets (``set_aux_loss_backward_scale``: 1/num_microbatches times the fp16 loss scale, the
factor the language-model loss gets), and the data-parallel gradient averaging then treats
it like the main loss.
"""

from __future__ import annotations

import collections

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megatron.core.torch_private import in_backward

from ..layers import normal_weight_zero_bias_
from .config import aux_loss_coeffs

_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


# ---------------------------------------------------------------------------------------
# Routing math (functions of tensors, tested on their own)
# ---------------------------------------------------------------------------------------


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int,
                       group_topk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [T, k]: the top-k of ``scores`` [T, E] among the ``group_topk`` of
    ``num_groups`` equal expert groups whose best ``topk // group_topk`` scores sum highest."""
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter(
        1, group_scores.topk(group_topk, dim=-1).indices, True)
    allowed = chosen.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    return scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1)


def topk_routing_with_score_function(logits: torch.Tensor, topk: int, use_pre_softmax: bool = False,
                                     score_function: str = "softmax",
                                     scaling_factor: Optional[float] = None, num_groups: Optional[int] = None,
                                     group_topk: Optional[int] = None,
                                     expert_bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(routing_probs [T, E], routing_map [T, E] bool): each token's k experts and weights.
    ``expert_bias`` (sigmoid only) shifts the scores for the choice, not the weights."""

    def choose(scores):
        if group_topk:
            return group_limited_topk(scores, topk, num_groups, group_topk)
        return torch.topk(scores, k=topk, dim=1)

    if score_function == "softmax":
        if use_pre_softmax:
            probs, top_indices = choose(torch.softmax(logits, dim=-1, dtype=torch.float32))
        else:
            top_logits, top_indices = choose(logits)
            probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        if expert_bias is not None:
            _, top_indices = choose(scores + expert_bias.float())
            scores = scores.gather(1, top_indices)
        else:
            scores, top_indices = choose(scores)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"unknown score function {score_function!r}; use softmax or sigmoid.")
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_probs, routing_map


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4, groups: Tuple = ()) -> torch.Tensor:
    """Sinkhorn-Knopp on exp(cost) [T, E]: row and column scalings d0, d1 with rows summing
    to 1/T and columns to 1/E (to ``tol``, mean change of d1 per iteration).

    ``groups``: the groups this rank's tokens are one chunk of their sequences over (CP, SP):
    T and the column sums are over every chunk, so the scalings (and every rank's loop
    count, read from d1, which the all-reduce makes equal) are those of the whole sequences."""
    cost = torch.exp(cost)
    tokens = cost.size(0)
    if groups:
        count = torch.tensor([tokens], dtype=torch.float64, device=cost.device)
        for group in groups:
            dist.all_reduce(count, group=group)
        tokens = int(count.item())
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps, error, d1_old = 1e-8, float("inf"), d1
    while error > tol:
        d0 = (1 / tokens) / (torch.sum(d1 * cost, 1) + eps)
        column = torch.sum(d0.unsqueeze(1) * cost, 0)
        for group in groups:
            dist.all_reduce(column, group=group)
        d1 = (1 / d1.size(0)) / (column + eps)
        error = float(torch.mean(torch.abs(d1_old - d1)))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def sinkhorn_routing(logits: torch.Tensor, topk: int, training: bool,
                     groups: Tuple = ()) -> Tuple[torch.Tensor, torch.Tensor]:
    """(routing_probs, routing_map) of S-BASE routing (module docstring); ``groups`` as for
    :func:`sinkhorn`."""
    weights = torch.sigmoid(logits) if topk == 1 else torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    if training:
        with torch.no_grad():  # the choice carries no gradient
            top_indices = torch.topk(sinkhorn(logits.float(), groups=groups), k=topk, dim=1).indices
    else:
        top_indices = torch.topk(weights, k=topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return weights * routing_map, routing_map


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


def sequence_load_balancing_loss_func(scores: torch.Tensor, tokens_per_sequence_expert: torch.Tensor,
                                      sequence_length: int, topk: int, num_experts: int,
                                      coeff: float) -> torch.Tensor:
    """DeepSeek's sequence-wise balance loss: the Switch loss of each sequence, averaged over the
    B sequences. ``scores`` [B, S', E] (S' this rank's tokens of each sequence),
    ``tokens_per_sequence_expert`` [B, E] the top-k counts of the whole sequences of
    ``sequence_length`` tokens."""
    aggregated = scores.sum(dim=1)  # [B, E]
    num_sequences = scores.shape[0]
    return torch.sum(aggregated * tokens_per_sequence_expert) * (
        num_experts * coeff / (topk * sequence_length * sequence_length * num_sequences))


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


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass: an activation recompute (full
    recompute, or --recompute-modules moe). torch has no public query; its graph-task id
    is -1 outside a backward (torch's own checkpoint reads it the same way)."""
    return in_backward()


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


def data_parallel_groups(expert_parallel) -> Tuple:
    """Process groups whose successive all-reduces sum over the data-parallel ranks of this
    TP coordinate: one per dimension of the expert-parallel mesh other than ``tp`` (size-1
    dimensions left out); none without a mesh (one process). With the expert TP size apart
    from TP those axes mix TP ranks: the layout names the groups (``token_groups``)."""
    if getattr(expert_parallel, "token_groups", None) is not None:
        return tuple(expert_parallel.token_groups)
    mesh = getattr(expert_parallel, "mesh", None)
    if mesh is None:
        return ()
    names = mesh.mesh_dim_names
    return tuple(mesh.get_group(name) for i, name in enumerate(names) if name != "tp" and mesh.size(i) > 1)


class TopKRouter(nn.Module):
    """``weight`` [num_experts, hidden] (and ``bias`` with ``add_bias_linear``), Megatron's names;
    with ``moe_router_enable_expert_bias`` the fp32 buffer ``expert_bias`` [num_experts]
    (in checkpoints, Megatron's name) and the step's token counts behind its update.

    ``forward(x [T, H], num_sequences) -> (probs [T, E], routing_map [T, E])`` for the
    tokens of ``num_sequences`` sequences laid out sequence-major. In training with a
    backward to come, the aux and z losses are attached to the outputs. ``last_stats`` holds
    the last call's losses divided by their coefficients (what Megatron logs) and, with
    capacity dropping, the number of dropped (token, expert) assignments.
    ``data_parallel_groups``: the groups the statistics of ``global_aux_loss`` and of the
    expert bias are summed over (from ``expert_parallel``; none for one process)."""

    def __init__(self, config, expert_parallel=None):
        super().__init__()
        self.config = config
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.init_std = config.hidden_init_std
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=config.params_dtype))
        self.bias = (nn.Parameter(torch.empty(self.num_experts, dtype=config.params_dtype))
                     if config.add_bias_linear else None)
        self.aux_loss_coeffs = aux_loss_coeffs(config)
        self.data_parallel_groups = data_parallel_groups(expert_parallel)
        _check_mesh_spans_context_parallel(config, expert_parallel)
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32))
            # The counts since the last update (expert_bias.py): a plain attribute, not a
            # buffer, because DDP broadcasts rank 0's buffers before some forwards.
            self.local_tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.float32)
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        # global_aux_loss: the step's token counts so far (summed over data-parallel ranks).
        self.global_tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.float64)
        self.global_aux_steps = 0
        self.global_aux_means = collections.deque()  # each forward's mean, for its recompute
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

    @property
    def context_parallel_group(self):
        """The CP group the sequence is split over, else None."""
        config = self.config
        if getattr(config, "context_parallel_size", 1) > 1:
            return config.cp_group
        return None

    @property
    def split_groups(self) -> Tuple:
        """Every group this rank's tokens are one chunk of their sequences over (CP, then SP's TP)."""
        return tuple(g for g in (self.context_parallel_group, self.sequence_group) if g is not None)

    def _whole(self, share: torch.Tensor) -> torch.Tensor:
        """A loss of this rank's chunk summed over the split groups (for logging)."""
        share = share.detach().clone()
        for group in self.split_groups:
            dist.all_reduce(share, group=group)
        return share

    def _attach(self, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        # The engine averages gradients over CP ranks where TP sums them: x CP makes the
        # shares' gradients add up over CP, like the trainer's x CP on the LM loss.
        cp = getattr(self.config, "context_parallel_size", 1)
        return MoEAuxLossAutoScaler.apply(output, loss, self.aux_loss_backward_scale * cp)

    def _data_parallel_size(self) -> int:
        return math.prod(dist.get_world_size(group) for group in self.data_parallel_groups)

    def forward(self, x: torch.Tensor, num_sequences: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
        config = self.config
        if x.shape[0] % num_sequences:
            raise ValueError(f"{x.shape[0]} tokens are not {num_sequences} sequences of equal length.")
        logits = self.gating(x)
        if config.moe_router_force_load_balancing:
            # Upstream's benchmark mode: route by random normal logits (balanced on average);
            # the gradient still reaches the gating weights (straight-through).
            logits = logits + (torch.randn_like(logits) - logits).detach()
        with_losses = self.training and torch.is_grad_enabled()
        self.last_stats = {}
        chunks = math.prod(dist.get_world_size(g) for g in self.split_groups)
        if with_losses and config.moe_z_loss_coeff:
            z_loss = z_loss_func(logits, config.moe_z_loss_coeff) / chunks
            logits = self._attach(logits, z_loss)
            self.last_stats["z_loss"] = self._whole(z_loss) / config.moe_z_loss_coeff
        if config.moe_router_load_balancing_type == "sinkhorn":
            probs, routing_map = sinkhorn_routing(logits, self.topk, self.training, self.split_groups)
        else:
            if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
                self.expert_bias.data = self.expert_bias.data.float()  # a model cast must not round the bias
            probs, routing_map = topk_routing_with_score_function(
                logits, self.topk, use_pre_softmax=config.moe_router_pre_softmax,
                score_function=config.moe_router_score_function,
                scaling_factor=config.moe_router_topk_scaling_factor,
                num_groups=config.moe_router_num_groups, group_topk=config.moe_router_group_topk,
                expert_bias=self.expert_bias,
            )
        if config.moe_expert_capacity_factor is not None:
            chosen = routing_map
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, self.topk, config.moe_expert_capacity_factor,
                drop_policy=config.moe_token_drop_policy, pad_to_capacity=config.moe_pad_expert_input_to_capacity,
            )
            self.last_stats["dropped_tokens"] = self._whole((chosen & ~routing_map).sum())
        if with_losses and self.aux_loss_coeffs:
            probs = self._attach_load_balancing_losses(probs, logits, num_sequences, chunks)
        if with_losses and self.expert_bias is not None and not recomputing():
            # Once per training forward: a recompute in backward does not count again.
            self.local_tokens_per_expert = self.local_tokens_per_expert.to(routing_map.device) + routing_map.sum(dim=0)
        return probs, routing_map

    def _attach_load_balancing_losses(self, probs, logits, num_sequences: int, chunks: int) -> torch.Tensor:
        """``probs`` with each configured load-balancing loss attached (module docstring)."""
        coeffs, groups = self.aux_loss_coeffs, self.split_groups
        aux_map, scores = scores_for_aux_loss(logits, self.topk, self.config.moe_router_score_function)
        num_tokens = logits.shape[0]
        losses = {}
        if "aux_loss" in coeffs:
            tokens_per_expert = aux_map.sum(dim=0)
            for group in groups:  # the whole sequence's counts
                dist.all_reduce(tokens_per_expert, group=group)
            losses["load_balancing_loss"] = (coeffs["aux_loss"], switch_load_balancing_loss_func(
                scores, tokens_per_expert, num_tokens * chunks, self.topk, self.num_experts, coeffs["aux_loss"]), 1)
        if "seq_aux_loss" in coeffs:
            shape = (num_sequences, num_tokens // num_sequences, self.num_experts)
            per_sequence = aux_map.view(shape).sum(dim=1)
            for group in groups:
                dist.all_reduce(per_sequence, group=group)
            losses["seq_load_balancing_loss"] = (coeffs["seq_aux_loss"], sequence_load_balancing_loss_func(
                scores.view(shape), per_sequence, shape[1] * chunks, self.topk, self.num_experts,
                coeffs["seq_aux_loss"]), 1)
        if "global_aux_loss" in coeffs:
            sp = (self.sequence_group,) if self.sequence_group is not None else ()
            if recomputing():
                # An activation recompute in backward reuses its forward's mean: recomputes
                # run in the order of the forwards, but after later forwards under 1F1B
                # (and right after their own without pipelining), so the running mean would
                # have moved on. All data-parallel ranks skip the all-reduce alike.
                mean_counts = self.global_aux_means.popleft()
            else:
                counts = aux_map.sum(dim=0).to(torch.float64)
                # The data-parallel groups already span CP; add SP's TP group.
                for dp_group in self.data_parallel_groups + sp:
                    dist.all_reduce(counts, group=dp_group)
                # Upstream's running mean over the step's micro-batches (reset by
                # set_aux_loss_backward_scale at the start of each step).
                self.global_tokens_per_expert = self.global_tokens_per_expert.to(counts.device) + counts
                self.global_aux_steps += 1
                mean_counts = (self.global_tokens_per_expert / self.global_aux_steps).to(scores.dtype)
                self.global_aux_means.append(mean_counts)
            dp = self._data_parallel_size()  # x CP under context parallelism
            sp_chunks = dist.get_world_size(sp[0]) if sp else 1
            cp = getattr(self.config, "context_parallel_size", 1)
            # Each rank's loss is its share; the log shows the whole (the mean over DP x dp,
            # _whole having summed the CP shares already).
            losses["global_load_balancing_loss"] = (coeffs["global_aux_loss"], switch_load_balancing_loss_func(
                scores, mean_counts, num_tokens * sp_chunks * dp, self.topk, self.num_experts,
                coeffs["global_aux_loss"]), dp // cp)
        for name, (coeff, loss, log_factor) in losses.items():
            probs = self._attach(probs, loss)
            self.last_stats[name] = self._whole(loss) * log_factor / coeff
        return probs


def _check_mesh_spans_context_parallel(config, expert_parallel) -> None:
    """Under CP, the expert mesh must count the CP ranks as data-parallel ranks (as
    ``parallel_state`` builds it), else global counts would miss the other CP ranks' tokens."""
    mesh = getattr(expert_parallel, "mesh", None)
    if mesh is None or getattr(config, "context_parallel_size", 1) == 1:
        return
    if not set(dist.get_process_group_ranks(config.cp_group)) <= set(mesh.mesh.flatten().tolist()):
        raise ValueError("the expert-parallel mesh does not contain this rank's CP group; build the expert layout "
                         "from megatron.core.parallel_state (initialize_model_parallel(..., context_parallel_size=C, "
                         "expert_model_parallel_size=P)), which folds the CP ranks in.")


def set_aux_loss_backward_scale(model: nn.Module, scale: float) -> None:
    """The factor the router losses' gradients get in the next backward passes: the one the
    language-model loss of a micro-batch gets (1/num_microbatches, times the fp16 loss scale).
    The trainer calls it at the start of every step, so it also starts the step's running
    token counts of ``global_aux_loss``."""
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.aux_loss_backward_scale = float(scale)
            module.global_tokens_per_expert = torch.zeros_like(module.global_tokens_per_expert)
            module.global_aux_steps = 0
            module.global_aux_means.clear()
