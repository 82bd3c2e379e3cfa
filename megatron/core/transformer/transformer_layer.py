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

import contextlib
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .attention import SelfAttention
from .gated_delta_net import GatedDeltaNet, linear_attention_pattern
from .layers import reset_parameters_of
from .mlp import MLP
from .moe.config import is_moe_layer
from .moe.moe_layer import MoELayer
from .multi_latent_attention import MLASelfAttention
from .norms import build_norm
from .recompute import recompute_saved, recomputes
from .transformer_config import TransformerConfig


class TransformerLayer(nn.Module):
    def __init__(self, config: TransformerConfig, layer_number: int = 1, expert_parallel=None,
                 moe: Optional[bool] = None, linear_attention: Optional[bool] = None):
        """``moe``: whether the MLP is a MoE layer (default: what ``moe_layer_freq`` says for
        ``layer_number``; a multi-token prediction layer takes the last layer's kind).
        ``linear_attention``: whether ``self_attention`` is a gated delta net (default: what
        ``linear_attention_freq`` says for ``layer_number``; softmax attention past the
        decoder's layers, i.e. in a multi-token prediction layer, as Qwen3-Next's MTP)."""
        super().__init__()
        moe = is_moe_layer(config, layer_number) if moe is None else moe
        if linear_attention is None:
            linear_attention = (layer_number <= config.num_layers
                                and bool(linear_attention_pattern(config)[layer_number - 1]))
        self.config = config
        self.layer_number = layer_number  # 1-based, as in Megatron
        self.input_layernorm = build_norm(config, config.hidden_size)
        if linear_attention:
            self.self_attention = GatedDeltaNet(config, layer_number)
        else:
            self.self_attention = (MLASelfAttention if config.multi_latent_attention else SelfAttention)(
                config, layer_number)
        self.pre_mlp_layernorm = build_norm(config, config.hidden_size)
        # A MoE layer (moe/moe_layer.py) replaces the MLP where --moe-layer-freq says so.
        if moe:
            self.mlp = MoELayer(config, layer_number, expert_parallel)
        else:
            self.mlp = MLP(config)
        # Selective recompute (recompute.py): the norms' outputs, and the whole dense MLP or MoE layer.
        self.recompute_layernorm = recomputes(config, "layernorm")
        self.recompute_mlp = recomputes(config, "moe" if moe else "mlp")

    def reset_parameters(self) -> None:
        """Re-run Megatron's initialization for this layer's parameters."""
        reset_parameters_of(self)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        dropout = self.config.hidden_dropout
        recompute = self.training and torch.is_grad_enabled()
        with self._norm_output(self.input_layernorm, hidden_states, recompute) as normed:
            attention_out = self.self_attention(normed, attention_mask, rotary_pos_emb)
        hidden_states = hidden_states + F.dropout(attention_out, p=dropout, training=self.training)
        with self._norm_output(self.pre_mlp_layernorm, hidden_states, recompute) as normed:
            if recompute and self.recompute_mlp:
                mlp_out = checkpoint(self.mlp, normed, use_reentrant=False)
            else:
                mlp_out = self.mlp(normed)
        return hidden_states + F.dropout(mlp_out, p=dropout, training=self.training)

    @contextlib.contextmanager
    def _norm_output(self, norm, hidden_states, recompute):
        """norm(hidden_states); with "layernorm" recompute, the ops inside the block do not keep
        it for their backward but recompute it from hidden_states (kept for the residual)."""
        normed = norm(hidden_states)
        if not (recompute and self.recompute_layernorm):
            yield normed
            return
        with recompute_saved(normed, lambda: norm(hidden_states)):
            yield normed
