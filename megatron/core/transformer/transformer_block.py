"""The decoder stack: ``layers`` (an nn.ModuleList of TransformerLayer) and ``final_layernorm``.

Full activation recompute (``recompute_granularity="full"``, see TransformerConfig for the
methods) wraps calls of layers in ``torch.utils.checkpoint.checkpoint``: only a chunk's
input is kept, and its layers run again in backward. The checkpointed function calls the
layer modules themselves (their ``__call__``), as in Megatron-LM, so module hooks (e.g.
the FSDP engine's unshard hooks) run again during recomputation; the engine recognises
that forward. Selective recompute lives in the attention (attention.py).
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
    def __init__(self, config: TransformerConfig, expert_parallel=None):
        super().__init__()
        if config.transformer_impl == "transformer_engine":
            import_transformer_engine()  # fail with the clear message before building anything
        self.config = config
        self.layers = nn.ModuleList(TransformerLayer(config, layer_number=i + 1, expert_parallel=expert_parallel)
                                    for i in range(config.num_layers))
        self.final_layernorm = build_norm(config, config.hidden_size)

    def reset_parameters(self) -> None:
        reset_parameters_of(self)

    def recompute_chunks(self):
        """[(number of consecutive layers, recomputed?)] under full recompute."""
        n = len(self.layers)
        method, k = self.config.recompute_method, self.config.recompute_num_layers or 1
        if method == "block":
            return [(1, True)] * k + ([(n - k, False)] if k < n else [])
        return [(min(k, n - start), True) for start in range(0, n, k)]  # uniform (also the default)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        # Recompute only when a backward will follow; in eval / no_grad it would cost nothing
        # to skip and reentrant checkpointing would warn.
        recompute = (self.config.recompute_granularity == "full" and self.training and torch.is_grad_enabled())
        chunks = self.recompute_chunks() if recompute else [(len(self.layers), False)]
        start = 0
        for size, checkpointed in chunks:
            layers = self.layers[start:start + size]
            start += size
            if checkpointed:
                hidden_states = checkpoint(_run_layers, layers, hidden_states, attention_mask, rotary_pos_emb,
                                           use_reentrant=self.config.recompute_reentrant)
            else:
                hidden_states = _run_layers(layers, hidden_states, attention_mask, rotary_pos_emb)
        return self.final_layernorm(hidden_states)


def _run_layers(layers, hidden_states, attention_mask, rotary_pos_emb):
    for layer in layers:
        hidden_states = layer(hidden_states, attention_mask, rotary_pos_emb)
    return hidden_states
