"""``MoELayer``: the mixture of experts that replaces a layer's MLP (Megatron's module names).

    router -> token_dispatcher.dispatch -> experts -> token_dispatcher.combine (+ shared_experts)

Input and output are ``[b, s, h]``; the router and the dispatcher see the ``b * s`` tokens
of this rank. ``shared_experts`` (``moe_shared_expert_intermediate_size``) is a dense MLP
every token goes through, added to the routed output.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ..mlp import MLP
from .expert_parallel import ExpertParallel
from .experts import GroupedMLP
from .metrics import MoELayerMetrics
from .router import TopKRouter
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
        self.config = config
        self.layer_number = layer_number
        self.expert_parallel = expert_parallel
        self.router = TopKRouter(config)
        self.experts = GroupedMLP(config, expert_parallel)
        self.token_dispatcher = MoEAlltoAllTokenDispatcher(config.num_moe_experts, expert_parallel)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = MLP(dataclasses.replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size))
        self.metrics = MoELayerMetrics(config.num_moe_experts)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        probs, routing_map = self.router(tokens)
        rows, row_probs, tokens_per_expert, handle = self.token_dispatcher.dispatch(tokens, probs, routing_map)
        expert_output = self.experts(rows, tokens_per_expert, row_probs)
        output = self.token_dispatcher.combine(expert_output, handle)
        if self.shared_experts is not None:
            output = output + self.shared_experts(tokens)
        if self.training:
            stats = self.router.last_stats
            self.metrics.record(handle["tokens_per_expert"], stats.get("dropped_tokens", 0),
                                {k: v for k, v in stats.items() if k != "dropped_tokens"})
        return output.view(shape)
