"""Tensor parallelism (and sequence parallelism): layers, region mappings, vocab-parallel loss."""

from .cross_entropy import vocab_parallel_cross_entropy
from .finalize_grads import all_reduce_sequence_parallel_grads, tensor_parallel_parameters
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "all_reduce_sequence_parallel_grads",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "tensor_parallel_parameters",
    "vocab_parallel_cross_entropy",
]
