"""``MoELayer``: the mixture of experts that replaces a layer's MLP (Megatron's module names).

    router -> token_dispatcher.dispatch -> experts -> token_dispatcher.combine (+ shared_experts)

Input and output are ``[b, s, h]``; the router and the dispatcher see the ``b * s`` tokens
of this rank (the router is told they are ``b`` sequences, for ``seq_aux_loss``).
``shared_experts`` (``moe_shared_expert_intermediate_size``) is a dense MLP every token
goes through (gated with ``moe_shared_expert_gate``, shared_experts.py), added to the
routed output.

Under tensor parallelism the experts are split over TP (``experts.py``) and each TP rank
dispatches over its own EP group (the ranks of its TP coordinate), so the layer works like
the dense MLP's column-parallel input and row-parallel output:

* without sequence parallelism every TP rank holds the same tokens and routes them the
  same way; the tokens and the router weights enter the experts through
  ``copy_to_tensor_model_parallel_region`` (backward sums their gradients, which each
  rank has only for its piece of the experts), and the partial outputs, combined, are
  summed with ``reduce_from_tensor_model_parallel_region``;
* with sequence parallelism each rank routes its own sequence chunk (the router's losses
  are its chunk's share, ``router.py``); tokens, router weights and routing map are
  gathered over TP (``gather_from_sequence_parallel_region``, backward reduce-scatters)
  and the output is reduce-scattered back to the chunks
  (``reduce_scatter_to_sequence_parallel_region``).

The router is outside these regions: its gradients are whole on every TP rank without
sequence parallelism, and its chunk's with it (``finalize_grads`` sums them), like every
other TP-replicated parameter.

With an expert tensor-parallel size apart from the TP size (``expert_parallel.py``: the
expert mesh's ``tp`` axis of size ETP, EP groups that may span TP ranks) the tokens take
upstream's path through the all-to-all dispatcher, around the same experts:

* each rank of the stage first holds tokens no other rank holds: with sequence
  parallelism its chunk already; without it, its chunk of the TP-replicated tokens,
  router weights and map (``scatter_to_sequence_parallel_region``: backward all-gathers,
  so the router's and the input's gradients are whole on every TP rank again);
* the chunks are gathered over the expert TP group (``gather_from_sequence_parallel_region``),
  so its ranks see the same rows, each with its piece of the experts; the all-to-all runs
  over the expert mesh's EP group;
* the partial outputs are reduce-scattered back over the expert TP group, then, without
  sequence parallelism, all-gathered over TP (backward keeps the rank's chunk: the
  gradient that follows is the same on every TP rank).

Each token is routed once in the stage, so the experts' gradients need the divisor of
``expert_parallel.py``. The layer's token counts (metrics) stay the whole micro-batch's
of a data-parallel rank, summed over TP under sequence parallelism.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

from .expert_parallel import ExpertParallel
from .experts import GroupedMLP
from ..recompute import recomputes
from .metrics import MoELayerMetrics
from .router import TopKRouter
from .shared_experts import SharedExpertMLP
from .token_dispatcher import MoEAlltoAllTokenDispatcher


class MoELayer(nn.Module):
    def __init__(self, config, layer_number: int = 1, expert_parallel: ExpertParallel = None):
        super().__init__()
        expert_parallel = expert_parallel or ExpertParallel()
        if expert_parallel.size != config.expert_model_parallel_size:
            raise ValueError(
                f"the config's expert_model_parallel_size ({config.expert_model_parallel_size}) differs from the "
                f"expert-parallel layout the model is built with (size {expert_parallel.size}); build the layout "
                "with build_expert_parallel(config.expert_model_parallel_size, ...)."
            )
        tp = config.tensor_model_parallel_size
        etp = getattr(config, "expert_tensor_parallel_size", None) or tp
        if expert_parallel.mesh is not None and expert_parallel.tp_size != etp:
            # Else EP groups and expert-data-parallel groups would mix different TP pieces.
            raise ValueError(
                f"the expert-parallel layout was built for TP size {expert_parallel.tp_size} (the experts' split), the "
                f"model splits its experts {etp} ways (tensor_model_parallel_size {tp}, expert_tensor_parallel_size "
                f"{config.expert_tensor_parallel_size}); build it with build_expert_parallel(..., tp_size={tp}"
                + (f", expert_tp_size={etp})." if etp != tp else ")."))
        if expert_parallel.tensor_parallel_apart and expert_parallel.dense_tp_size != tp:
            raise ValueError(f"the expert-parallel layout was built for TP size {expert_parallel.dense_tp_size}, the "
                             f"model has tensor_model_parallel_size {tp}; build it with tp_size={tp}.")
        self.config = config
        self.layer_number = layer_number
        self.expert_parallel = expert_parallel
        self.router = TopKRouter(config, expert_parallel)
        self.experts = GroupedMLP(config, expert_parallel)
        self.token_dispatcher = MoEAlltoAllTokenDispatcher(config.num_moe_experts, expert_parallel)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(config)
        self.metrics = MoELayerMetrics(config.num_moe_experts)
        self.recompute_shared_experts = self.shared_experts is not None and recomputes(config, "shared_experts")
        self.tp_group = config.tp_group if config.tensor_model_parallel_size > 1 else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        probs, routing_map = self.router(hidden_states.reshape(-1, shape[-1]), num_sequences=shape[0])
        if self.expert_parallel.tensor_parallel_apart:
            output, token_counts = self._experts_apart_from_tensor_parallel(hidden_states, probs, routing_map)
        else:
            tokens, probs, routing_map = self._enter_tensor_parallel(hidden_states, probs, routing_map)
            output, token_counts = self._routed(tokens, probs, routing_map)
            output = self._leave_tensor_parallel(output)
        if self.shared_experts is not None:
            if self.recompute_shared_experts and self.training and torch.is_grad_enabled():
                output = output + checkpoint(self.shared_experts, hidden_states, use_reentrant=False)
            else:
                output = output + self.shared_experts(hidden_states)
        if self.training:
            stats = self.router.last_stats
            self.metrics.record(token_counts, stats.get("dropped_tokens", 0),
                                {k: v for k, v in stats.items() if k != "dropped_tokens"})
        return output

    def _routed(self, tokens, probs, routing_map):
        """(dispatch -> experts -> combine of ``tokens`` [b, s, h], this rank's token counts)."""
        rows, row_probs, tokens_per_expert, handle = self.token_dispatcher.dispatch(
            tokens.reshape(-1, tokens.shape[-1]), probs, routing_map)
        expert_output = self.experts(rows, tokens_per_expert, row_probs)
        return self.token_dispatcher.combine(expert_output, handle).view(tokens.shape), handle["tokens_per_expert"]

    def _experts_apart_from_tensor_parallel(self, hidden_states, probs, routing_map):
        """The expert TP group is not the TP group (module docstring): (output, token counts)."""
        b, s, h = hidden_states.shape
        experts = probs.shape[-1]
        counts = routing_map.sum(dim=0)
        tokens, probs = hidden_states, probs.reshape(b, s, experts)
        routing_map = routing_map.reshape(b, s, experts).to(torch.uint8)  # gloo gathers no bool
        tp_group, sequence_parallel = self.tp_group, self.config.sequence_parallel
        if tp_group is not None:
            if sequence_parallel:  # the counts of the data-parallel rank's micro-batch, as at ETP = TP
                counts = counts.clone()
                dist.all_reduce(counts, group=tp_group)
            else:  # every TP rank holds the same tokens: keep this rank's chunk
                tokens = scatter_to_sequence_parallel_region(tokens, tp_group)
                probs = scatter_to_sequence_parallel_region(probs, tp_group)
                routing_map = routing_map.chunk(dist.get_world_size(tp_group), dim=1)[dist.get_rank(tp_group)]
        etp_group = self.expert_parallel.tp_group
        if etp_group is not None:
            tokens = gather_from_sequence_parallel_region(tokens, etp_group)
            probs = gather_from_sequence_parallel_region(probs, etp_group)
            routing_map = gather_from_sequence_parallel_region(routing_map, etp_group)
        output, _ = self._routed(tokens, probs.reshape(-1, experts), routing_map.reshape(-1, experts).bool())
        if etp_group is not None:
            output = reduce_scatter_to_sequence_parallel_region(output, etp_group)
        if tp_group is not None and not sequence_parallel:
            output = gather_from_sequence_parallel_region(output, tp_group, tensor_parallel_output_grad=False)
        return output, counts

    def _enter_tensor_parallel(self, hidden_states, probs, routing_map):
        """(tokens [b, s, h], probs and routing map [b * s, E]) for the experts of this TP rank."""
        group = self.tp_group
        if group is None:
            return hidden_states, probs, routing_map
        if not self.config.sequence_parallel:
            return (copy_to_tensor_model_parallel_region(hidden_states, group),
                    copy_to_tensor_model_parallel_region(probs, group), routing_map)
        b, chunk = hidden_states.shape[:2]
        experts = probs.shape[-1]
        tokens = gather_from_sequence_parallel_region(hidden_states, group)
        probs = gather_from_sequence_parallel_region(probs.reshape(b, chunk, experts), group).reshape(-1, experts)
        # The map needs no gradient; gloo gathers no bool.
        routing_map = gather_from_sequence_parallel_region(
            routing_map.reshape(b, chunk, experts).to(torch.uint8), group).reshape(-1, experts).bool()
        return tokens, probs, routing_map

    def _leave_tensor_parallel(self, partial: torch.Tensor) -> torch.Tensor:
        """The experts' output summed over TP (this rank's chunk with sequence parallelism)."""
        if self.tp_group is None:
            return partial
        if self.config.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group)
