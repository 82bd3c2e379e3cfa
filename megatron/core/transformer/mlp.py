"""The feed-forward block: ``linear_fc1`` -> activation -> ``linear_fc2``.

With ``gated_linear_unit`` (SwiGLU when the activation is silu), ``linear_fc1`` outputs
``2 * ffn_hidden_size`` features: rows ``[0, ffn)`` are the gate (Hugging Face Llama's
``gate_proj``) and rows ``[ffn, 2 * ffn)`` the up projection (``up_proj``); the result is
``act(gate) * up`` (GPT-OSS's offset and clamp: gpt_oss.py). This is Megatron-LM's order, so converters concatenate gate then up.
"""

import torch
import torch.nn as nn

from .layers import build_parallel_linear, output_init_std
from .swiglu import gated_linear_unit
from .transformer_config import TransformerConfig


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.activation = config.activation
        self.gated = config.gated_linear_unit
        fc1_out = config.ffn_hidden_size * (2 if self.gated else 1)
        # Tensor parallelism: fc1 column-parallel (gate and up split on their own, so a
        # rank's gate and up rows match), fc2 row-parallel.
        self.linear_fc1 = build_parallel_linear(config, config.hidden_size, fc1_out, bias=config.add_bias_linear,
                                                init_std=config.hidden_init_std, split="column",
                                                blocks=2 if self.gated else 1)
        self.linear_fc2 = build_parallel_linear(config, config.ffn_hidden_size, config.hidden_size,
                                                bias=config.add_bias_linear, init_std=output_init_std(config),
                                                split="row")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        intermediate = self.linear_fc1(hidden_states)
        if self.gated:
            intermediate = gated_linear_unit(self.config, intermediate)
        else:
            intermediate = self.activation(intermediate)
        return self.linear_fc2(intermediate)
