"""One pre-norm decoder layer (Megatron-LM module names)::

    x = x + dropout(self_attention(input_layernorm(x)))
    x = x + dropout(mlp(pre_mlp_layernorm(x)))

With ``transformer_impl="transformer_engine"`` the module tree and parameter names stay
the same; only the leaves change (``te.Linear`` for the four linears, ``te.LayerNorm`` /
``te.RMSNorm`` for the norms, see layers.py / norms.py). We chose this over
``te.TransformerLayer`` or the fused ``te.LayerNormLinear`` so that local and TE
checkpoints are interchangeable and the FSDP engine sees the same units either way.
Attention always runs in torch's ``scaled_dot_product_attention`` (flash / cuDNN kernels
on GPU).
"""

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import SelfAttention
from .layers import reset_parameters_of
from .mlp import MLP
from .multi_latent_attention import MLASelfAttention
from .moe.config import is_moe_layer
from .norms import build_norm
from .transformer_config import TransformerConfig


class TransformerLayer(nn.Module):
    def __init__(self, config: TransformerConfig, layer_number: int = 1, expert_parallel=None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number  # 1-based, as in Megatron
        self.input_layernorm = build_norm(config, config.hidden_size)
        self.self_attention = (MLASelfAttention if config.multi_latent_attention else SelfAttention)(config,
                                                                                                   layer_number)
        self.pre_mlp_layernorm = build_norm(config, config.hidden_size)
        # A MoE layer (moe/moe_layer.py) replaces the MLP where --moe-layer-freq says so.
        if is_moe_layer(config, layer_number):
            from .moe.moe_layer import MoELayer

            self.mlp = MoELayer(config, layer_number, expert_parallel)
        else:
            self.mlp = MLP(config)

    def reset_parameters(self) -> None:
        """Re-run Megatron's initialization for this layer's parameters."""
        reset_parameters_of(self)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        dropout = self.config.hidden_dropout
        attention_out = self.self_attention(self.input_layernorm(hidden_states), attention_mask, rotary_pos_emb)
        hidden_states = hidden_states + F.dropout(attention_out, p=dropout, training=self.training)
        mlp_out = self.mlp(self.pre_mlp_layernorm(hidden_states))
        return hidden_states + F.dropout(mlp_out, p=dropout, training=self.training)
