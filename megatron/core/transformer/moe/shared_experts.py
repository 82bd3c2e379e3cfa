"""``SharedExpertMLP``: the dense MLP every token of a MoE layer goes through (Megatron's
``shared_experts``), optionally gated as in Qwen2-MoE.

``moe_shared_expert_gate`` adds ``gate_weight`` ([1, hidden], Megatron's name and shape,
normal(0, init_method_std) like Megatron's init_method): the output is scaled per token by
``sigmoid(x @ gate_weight^T)``. The weight is replicated over TP; it sees the same tokens as
the MLP's input, so its gradient is whole on every TP rank without sequence parallelism and
its chunk's with it (finalize_grads sums those, like every TP-replicated parameter).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..mlp import MLP


class SharedExpertMLP(MLP):
    def __init__(self, config):
        super().__init__(dataclasses.replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size))
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            self.init_std = config.hidden_init_std  # read by the layout-invariant initializer
            self.gate_weight = nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """The gate's initialization (the linears initialize themselves)."""
        if self.gate_weight is not None:
            with torch.no_grad():
                nn.init.normal_(self.gate_weight, mean=0.0, std=self.init_std)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output = super().forward(hidden_states)
        if self.gate_weight is None:
            return output
        return output * torch.sigmoid(F.linear(hidden_states, self.gate_weight))
