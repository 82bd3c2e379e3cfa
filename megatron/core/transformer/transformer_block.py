"""The decoder stack: ``layers`` (a LayerStack of TransformerLayer) and ``final_layernorm``.

Under pipeline parallelism a block holds only its stage's layers; they keep their global
numbers (``decoder.layers.5`` on whichever stage holds layer 5), and only the last stage
has the final norm.

Full activation recompute (``recompute_granularity="full"``, see TransformerConfig for the
methods) wraps calls of layers in ``torch.utils.checkpoint.checkpoint``: only a chunk's
input is kept, and its layers run again in backward. The checkpointed function calls the
layer modules themselves (their ``__call__``), as in Megatron-LM, so module hooks (e.g.
the FSDP engine's unshard hooks) run again during recomputation; the engine recognises
that forward. Selective recompute lives in the attention (attention.py).
"""

from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .backends import import_transformer_engine
from .layers import reset_parameters_of
from .norms import build_norm
from .transformer_config import TransformerConfig
from .transformer_layer import TransformerLayer


class LayerStack(nn.Module):
    """Layers registered under their global indices (``"5"`` for global layer 5), so that
    parameter names, seeded initialization and checkpoints are those of the whole model
    whichever pipeline stage builds them. Indexing, slicing and iteration are by position
    within the stack, like an ``nn.ModuleList``."""

    def __init__(self, layers: Iterable[nn.Module], global_indices: Sequence[int]):
        super().__init__()
        layers = list(layers)
        if len(layers) != len(global_indices):
            raise ValueError(f"{len(layers)} layers but {len(global_indices)} global indices; give one index per layer.")
        for index, layer in zip(global_indices, layers):
            self.add_module(str(int(index)), layer)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __getitem__(self, position: Union[int, slice]) -> Union[nn.Module, List[nn.Module]]:
        return list(self._modules.values())[position]


class TransformerBlock(nn.Module):
    """``layer_numbers``: the global (0-based) layers this block holds (a pipeline stage's);
    None: all ``config.num_layers``. ``post_layer_norm``: build the final norm (the last
    stage's)."""

    def __init__(self, config: TransformerConfig, expert_parallel=None,
                 layer_numbers: Optional[Sequence[int]] = None, post_layer_norm: bool = True):
        super().__init__()
        if config.transformer_impl == "transformer_engine":
            import_transformer_engine()  # fail with the clear message before building anything
        self.config = config
        numbers = list(range(config.num_layers)) if layer_numbers is None else [int(i) for i in layer_numbers]
        if any(not 0 <= i < config.num_layers for i in numbers):
            raise ValueError(f"layer_numbers {numbers} must lie in [0, num_layers={config.num_layers}).")
        self.layers = LayerStack((TransformerLayer(config, layer_number=i + 1, expert_parallel=expert_parallel)
                                  for i in numbers), numbers)
        self.final_layernorm = build_norm(config, config.hidden_size) if post_layer_norm else None

    def reset_parameters(self) -> None:
        reset_parameters_of(self)

    def recompute_chunks(self):
        """[(number of consecutive layers, recomputed?)] under full recompute."""
        n = len(self.layers)
        method, k = self.config.recompute_method, self.config.recompute_num_layers or 1
        if method == "block":  # the first k layers of this block (of each pipeline stage, as in Megatron)
            k = min(k, n)
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
        return self.final_layernorm(hidden_states) if self.final_layernorm is not None else hidden_states


def _run_layers(layers, hidden_states, attention_mask, rotary_pos_emb):
    for layer in layers:
        hidden_states = layer(hidden_states, attention_mask, rotary_pos_emb)
    return hidden_states
