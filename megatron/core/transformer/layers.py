"""Leaf layers with Megatron's initialization built in.

Each leaf owns its initialization in ``reset_parameters()``, so initializing a model is
"call reset_parameters on every module that owns parameters" (see
``reset_parameters_of``). That works in any traversal order and after building on the
``meta`` device followed by ``to_empty()``, which is how sharded models are materialized.
"""

import math
from typing import Optional

import torch
import torch.nn as nn

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.grad_accumulation_fusion import embedding as fused_embedding
from megatron.core.tensor_parallel.grad_accumulation_fusion import linear as fused_linear

from .backends import import_transformer_engine, te_device
from .transformer_config import TransformerConfig


def output_init_std(config: TransformerConfig) -> float:
    """Std for projections that write into the residual stream (linear_proj, linear_fc2).

    Megatron scales them by 1/sqrt(2 * num_layers) so the residual stream's variance does
    not grow with depth (two such writes per layer).
    """
    return config.hidden_init_std / math.sqrt(2.0 * config.num_layers)


def normal_weight_zero_bias_(module: nn.Module) -> None:
    """Megatron's rule for a module with ``weight``, optional ``bias`` and ``init_std``."""
    with torch.no_grad():
        nn.init.normal_(module.weight, mean=0.0, std=module.init_std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


class Linear(nn.Linear):
    """``nn.Linear`` initialized with normal(0, init_std) weights and zero bias; with
    ``gradient_accumulation_fusion`` its weight gradient is computed into the data-parallel
    reduction buffer where the wrapper offers one."""
    def __init__(self, in_features: int, out_features: int, bias: bool, init_std: float,
                 dtype: Optional[torch.dtype] = None, gradient_accumulation_fusion: bool = True):
        # Set before nn.Linear.__init__, which calls reset_parameters().
        self.init_std = init_std
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_linear(x, self.weight, self.bias, fusion=self.gradient_accumulation_fusion)


class Embedding(nn.Embedding):
    """``nn.Embedding`` initialized with normal(0, init_std) (nn.Embedding uses std 1); with
    ``gradient_accumulation_fusion`` the gradient of a weight tied to a fused output layer is
    added into that layer's slot in the reduction buffer."""
    def __init__(self, num_embeddings: int, embedding_dim: int, init_std: float,
                 dtype: Optional[torch.dtype] = None, gradient_accumulation_fusion: bool = True):
        self.init_std = init_std
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        super().__init__(num_embeddings, embedding_dim, dtype=dtype)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        plain = (self.padding_idx is None and self.max_norm is None and not self.scale_grad_by_freq
                 and not self.sparse)
        if not plain:
            return super().forward(ids)
        return fused_embedding(ids, self.weight, fusion=self.gradient_accumulation_fusion)


def build_linear(config: TransformerConfig, in_features: int, out_features: int, bias: bool,
                 init_std: float) -> nn.Module:
    """A linear layer: local ``Linear`` or ``te.Linear`` (same parameter names: weight, bias)."""
    if config.transformer_impl == "transformer_engine":
        te = import_transformer_engine()
        return te.Linear(
            in_features,
            out_features,
            bias=bias,
            init_method=lambda weight: nn.init.normal_(weight, mean=0.0, std=init_std),
            params_dtype=config.params_dtype,
            device=te_device(),
        )
    return Linear(in_features, out_features, bias=bias, init_std=init_std, dtype=config.params_dtype,
                  gradient_accumulation_fusion=config.gradient_accumulation_fusion)


def build_parallel_linear(config: TransformerConfig, in_features: int, out_features: int, bias: bool,
                          init_std: float, split: str, blocks: int = 1, sections=None) -> nn.Module:
    """``build_linear`` at TP size 1; else a column-parallel (``split="column"``, outputs
    split, ``blocks`` equal row blocks or blocks of the sizes ``sections`` each split on its
    own) or row-parallel (``"row"``) linear."""
    if config.tensor_model_parallel_size == 1:
        return build_linear(config, in_features, out_features, bias=bias, init_std=init_std)

    kwargs = dict(bias=bias, init_std=init_std, tp_group=config.tp_group,
                  sequence_parallel=config.sequence_parallel, dtype=config.params_dtype,
                  gradient_accumulation_fusion=config.gradient_accumulation_fusion)
    if split == "column":
        return ColumnParallelLinear(in_features, out_features, blocks=blocks, sections=sections, **kwargs)
    return RowParallelLinear(in_features, out_features, **kwargs)


def reset_parameters_of(root: nn.Module) -> None:
    """Re-initialize every parameter under ``root`` by calling ``reset_parameters()`` on each
    module that directly owns a parameter (local leaves, TE modules and apex norms all
    provide it). Containers own no parameters, so nothing is initialized twice."""
    with torch.no_grad():
        for module in root.modules():
            if not any(p is not None for p in module._parameters.values()):
                continue
            reset = getattr(module, "reset_parameters", None)
            if reset is None:
                raise RuntimeError(
                    f"{type(module).__name__} owns parameters but has no reset_parameters(); "
                    "give it one so the model can be initialized after a meta-device build."
                )
            reset()
