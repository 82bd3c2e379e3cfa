"""The decoder stack: ``layers`` (an nn.ModuleList of TransformerLayer) and ``final_layernorm``.

Activation recomputation (``recompute_granularity="full"``) wraps each layer's call in
``torch.utils.checkpoint.checkpoint``: only the layer's input is kept, and the layer is run
again in backward. The checkpointed function is the layer module itself (its
``__call__``), as in Megatron-LM, so module hooks (e.g. the FSDP engine's unshard hooks)
run again during recomputation; the engine is expected to recognise that forward.
"""

from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .backends import import_transformer_engine
from .layers import reset_parameters_of
from .norms import build_norm
from .transformer_config import TransformerConfig
from .transformer_layer import TransformerLayer


class TransformerBlock(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        if config.transformer_impl == "transformer_engine":
            import_transformer_engine()  # fail with the clear message before building anything
        self.config = config
        self.layers = nn.ModuleList(TransformerLayer(config, layer_number=i + 1) for i in range(config.num_layers))
        self.final_layernorm = build_norm(config, config.hidden_size)

    def reset_parameters(self) -> None:
        reset_parameters_of(self)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        # Recompute only when a backward will follow; in eval / no_grad it would cost nothing
        # to skip and reentrant checkpointing would warn.
        recompute = (self.config.recompute_granularity == "full" and self.training and torch.is_grad_enabled())
        for layer in self.layers:
            if recompute:
                hidden_states = checkpoint(layer, hidden_states, attention_mask, rotary_pos_emb,
                                           use_reentrant=self.config.recompute_reentrant)
            else:
                hidden_states = layer(hidden_states, attention_mask, rotary_pos_emb)
        return self.final_layernorm(hidden_states)
