"""Megatron-format token datasets: the .bin/.idx indexed dataset, GPT samples, blending."""

from megatron.core.datasets.blended_dataset import BlendedDataset, MockGPTDataset
from megatron.core.datasets.builder import build_gpt_datasets, parse_data_path
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
    optimal_dtype,
)
from megatron.core.datasets.utils import parse_split

__all__ = [
    "BlendedDataset",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MockGPTDataset",
    "build_gpt_datasets",
    "get_bin_path",
    "get_idx_path",
    "optimal_dtype",
    "parse_data_path",
    "parse_split",
]
