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
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
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
        if expert_parallel.mesh is not None and expert_parallel.tp_size != tp:
            # Else EP groups and expert-data-parallel groups would mix different TP pieces.
            raise ValueError(
                f"the expert-parallel layout was built for TP size {expert_parallel.tp_size}, the model has "
                f"tensor_model_parallel_size {tp}; build it with build_expert_parallel(..., tp_size={tp})."
            )
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
        tokens, probs, routing_map = self._enter_tensor_parallel(hidden_states, probs, routing_map)
        rows, row_probs, tokens_per_expert, handle = self.token_dispatcher.dispatch(
            tokens.reshape(-1, shape[-1]), probs, routing_map)
        expert_output = self.experts(rows, tokens_per_expert, row_probs)
        output = self._leave_tensor_parallel(self.token_dispatcher.combine(expert_output, handle).view(tokens.shape))
        if self.shared_experts is not None:
            if self.recompute_shared_experts and self.training and torch.is_grad_enabled():
                output = output + checkpoint(self.shared_experts, hidden_states, use_reentrant=False)
            else:
                output = output + self.shared_experts(hidden_states)
        if self.training:
            stats = self.router.last_stats
            self.metrics.record(handle["tokens_per_expert"], stats.get("dropped_tokens", 0),
                                {k: v for k, v in stats.items() if k != "dropped_tokens"})
        return output

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
