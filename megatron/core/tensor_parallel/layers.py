"""Tensor-parallel layers (Megatron-LM's names and semantics, batch-first activations).

Each layer's parameters are this rank's pieces of the global (TP size 1) parameters, as
plain tensors; the layer says which piece in ``global_slices``
(``megatron/core/global_slices.py``), which the invariant initializer, checkpoints and
converters read. Parameters without an entry (row-parallel biases) are the same on
every TP rank.

* ``ColumnParallelLinear``: ``Y = X A^T + b`` with ``A``'s rows (outputs) split; the
  input is the whole feature vector on every rank, the output this rank's features.
  ``blocks=2`` splits each of two stacked row blocks on its own (SwiGLU's [gate; up],
  so a rank holds matching gate and up rows); ``sections`` does the same for stacked
  blocks of unequal sizes (the gated delta net's [q; k; v; z; b; a]).
* ``RowParallelLinear``: ``A``'s columns (inputs) split; the input is this rank's
  features, the partial outputs are summed over TP, then the (replicated) bias added.
* ``VocabParallelEmbedding``: the vocabulary rows split; a rank looks up the ids it
  owns and the sum over TP assembles every embedding.

With ``sequence_parallel``, activations outside these layers are split along the
sequence: a column-parallel layer all-gathers its input (its backward reduce-scatters),
a row-parallel layer and the embedding reduce-scatter their output (instead of an
all-reduce).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megatron.core.global_slices import partition, partition_sections

from .grad_accumulation_fusion import embedding, linear
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def tp_rank_and_size(group: Optional[dist.ProcessGroup]):
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator}); "
                         "pick a --tensor-model-parallel-size that divides it.")
    return numerator // denominator


class _TensorParallelLayer(nn.Module):
    """What every TP layer has: its group, sequence parallelism, Megatron's init std."""

    def __init__(self, init_std: float, tp_group: Optional[dist.ProcessGroup], sequence_parallel: bool):
        super().__init__()
        self.init_std = init_std
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel

    def reset_parameters(self) -> None:
        # Global RNG, standalone use only; the trainer uses initialization.py (layout-invariant).
        if self.weight is not None:
            nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if getattr(self, "bias", None) is not None:
            nn.init.zeros_(self.bias)


class ColumnParallelLinear(_TensorParallelLayer):
    def __init__(self, input_size: int, output_size: int, *, bias: bool, init_std: float,
                 tp_group: Optional[dist.ProcessGroup], sequence_parallel: bool = False, blocks: int = 1,
                 sections=None, dtype: Optional[torch.dtype] = None, skip_weight_param_allocation: bool = False,
                 gradient_accumulation_fusion: bool = True):
        super().__init__(init_std, tp_group, sequence_parallel)
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        rank, size = tp_rank_and_size(tp_group)
        self.input_size, self.output_size = input_size, output_size
        divide(output_size, size * blocks, "the output size of a column-parallel linear")
        if sections is not None:
            for n in sections:
                divide(n, size, "each block of a column-parallel linear")
            cut = lambda shape: partition_sections(shape, 0, rank, size, sections)  # noqa: E731
        else:
            cut = lambda shape: partition(shape, 0, rank, size, blocks)  # noqa: E731
        self.global_slices = {"weight": cut((output_size, input_size))}
        if skip_weight_param_allocation:  # the caller passes the weight (tied output layer)
            self.weight = None
        else:
            self.weight = nn.Parameter(torch.empty(self.global_slices["weight"].local_shape, dtype=dtype))
        if bias:
            self.global_slices["bias"] = cut((output_size,))
            self.bias = nn.Parameter(torch.empty(self.global_slices["bias"].local_shape, dtype=dtype))
        else:
            self.bias = None
        self.reset_parameters()

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``weight`` overrides the own one (the output layer's tied embedding)."""
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        weight = self.weight if weight is None else weight
        if weight is None:
            raise RuntimeError("this column-parallel layer was built without its own weight; pass weight= "
                               "(the tied word-embedding weight), as GPTModel does.")
        return linear(x, weight, self.bias, fusion=self.gradient_accumulation_fusion)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size} (local {self.global_slices['weight'].local_shape[0]}), "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_TensorParallelLayer):
    def __init__(self, input_size: int, output_size: int, *, bias: bool, init_std: float,
                 tp_group: Optional[dist.ProcessGroup], sequence_parallel: bool = False,
                 dtype: Optional[torch.dtype] = None, gradient_accumulation_fusion: bool = True):
        super().__init__(init_std, tp_group, sequence_parallel)
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        rank, size = tp_rank_and_size(tp_group)
        self.input_size, self.output_size = input_size, output_size
        divide(input_size, size, "the input size of a row-parallel linear")
        self.global_slices = {"weight": partition((output_size, input_size), 1, rank, size)}
        self.weight = nn.Parameter(torch.empty(self.global_slices["weight"].local_shape, dtype=dtype))
        # Added after the reduction, so it is the same on every TP rank.
        self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype)) if bias else None
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = linear(x, self.weight, fusion=self.gradient_accumulation_fusion)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.input_size} (local {self.weight.shape[1]}), out={self.output_size}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(_TensorParallelLayer):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_std: float,
                 tp_group: Optional[dist.ProcessGroup], sequence_parallel: bool = False,
                 dtype: Optional[torch.dtype] = None, gradient_accumulation_fusion: bool = True):
        super().__init__(init_std, tp_group, sequence_parallel)
        rank, size = tp_rank_and_size(tp_group)
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = divide(num_embeddings, size, "the padded vocabulary size")
        self.vocab_start_index, self.vocab_end_index = rank * per_rank, (rank + 1) * per_rank
        self.global_slices = {"weight": partition((num_embeddings, embedding_dim), 0, rank, size)}
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, dtype=dtype))
        self.reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[b, s] ids -> [b, s, h], or [b, s / tp, h] (this rank's sequence chunk) with
        sequence parallelism."""
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        partial = embedding(local_ids, self.weight, fusion=self.gradient_accumulation_fusion)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (local [{self.vocab_start_index}, {self.vocab_end_index})), {self.embedding_dim}"
