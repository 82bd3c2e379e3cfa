"""Which parameters Muon updates, and the matrices each one is made of.

Upstream Megatron-LM's rule: Muon takes every trainable 2-D parameter except the word
embedding and the output layer (``is_embedding_or_output_parameter``); everything else
(biases, norms, 1-D parameters, those two) falls back to the scalar optimizer (AdamW). So
the attention and MLP projections, the experts and the MoE router weight are Muon's.

A parameter is not always one matrix:

* ``linear_qkv.weight`` (with ``--muon-split-qkv``, upstream's default) holds, per query
  group, its query rows, their gate rows (``--attention-output-gate``), the key rows and
  the value rows (``attention.py``'s layout, upstream's too); the queries of all groups
  are one matrix, the gates one, the keys one, the values one.
* an experts' ``ExpertLinear.weight`` stacks its local experts' matrices along dim 0
  (upstream's grouped-GEMM experts hold one weight per expert): each expert is one matrix.

Under tensor parallelism a rank holds a piece of each split matrix: rows
(column-parallel) or columns (row-parallel), ``tp_dim``; upstream's ``--muon-tp-mode``
decides whether the pieces are gathered (``duplicated``, ``distributed``) or
orthogonalized on their own (``blockwise``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import ExpertLinear

# The package's rule (its __init__ imports this module only inside the factory).
from .param_groups import is_embedding_or_output_parameter


@dataclasses.dataclass(frozen=True)
class MuonMatrix:
    """How one Muon parameter's (TP piece of its) value is cut into matrices."""
    experts: int = 0  # > 0: that many matrices stacked along dim 0, orthogonalized one by one
    qkv_split: Optional[Tuple[int, ...]] = None  # rows of each part within a query group
    tp_group: Any = None  # the group whose ranks hold the other pieces (None: not split)
    tp_dim: Optional[int] = None  # 0: the pieces are row blocks; 1: column blocks


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """Upstream's split: trainable 2-D parameters other than the embedding and output layer."""
    return param.requires_grad and len(param.shape) == 2 and not is_embedding_or_output_parameter(name)


def qkv_split_rows(config) -> Tuple[int, ...]:
    """Rows per query group of each part of ``linear_qkv``: query, [gate,] key, value."""
    per_group = config.num_attention_heads // config.num_query_groups * config.kv_channels
    gate = (per_group,) if getattr(config, "attention_output_gate", False) else ()
    return (per_group,) + gate + (config.kv_channels, config.kv_channels)


def muon_matrices(model: torch.nn.Module, split_qkv: bool = True) -> Dict[int, MuonMatrix]:
    """``{id(parameter): MuonMatrix}`` for every parameter of ``model`` that Muon takes."""
    config = getattr(model, "config", None)
    names = {id(p): n for n, p in model.named_parameters()}
    out: Dict[int, MuonMatrix] = {}
    for module_name, module in model.named_modules():
        for attr, param in module._parameters.items():
            if param is None or id(param) not in names or not takes_muon(names[id(param)], param):
                continue
            spec = MuonMatrix()
            if isinstance(module, ExpertLinear):
                spec = MuonMatrix(experts=module.num_local_experts)
                if module.tp_split is not None:
                    spec = dataclasses.replace(spec, tp_group=module.tp_group,
                                               tp_dim=0 if module.tp_split == "column" else 1)
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and attr in module.global_slices:
                spec = MuonMatrix(tp_group=module.tp_group, tp_dim=module.global_slices[attr].dim)
            if split_qkv and config is not None and module_name.endswith("linear_qkv") and attr == "weight":
                rows = qkv_split_rows(config)
                # A DTensor's shape is its data-parallel global one: this TP rank's rows.
                if param.shape[0] % sum(rows) == 0:  # else upstream leaves it whole too
                    spec = dataclasses.replace(spec, qkv_split=rows)
            out.setdefault(id(param), spec)
    return out

