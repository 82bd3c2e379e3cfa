"""Blending several datasets by weight, and the synthetic dataset behind ``--mock-data``."""

import json
import logging
import os
from typing import Dict, Optional, Sequence

import numpy as np

from megatron.core.datasets.gpt_dataset import packed_document_fields
from megatron.core.datasets.utils import (
    atomic_save_npy,
    atomic_write_text,
    check_cache_name,
    description_hash,
    load_cached_arrays,
    prepare_cache_dir,
)

logger = logging.getLogger(__name__)


def normalize_weights(weights: Sequence[float], num_datasets: int) -> np.ndarray:
    """Weights as float64 summing to 1; raises ValueError on anything unusable."""
    if len(weights) != num_datasets:
        raise ValueError(
            f"got {len(weights)} weights for {num_datasets} datasets; give exactly one weight per dataset."
        )
    try:
        array = np.asarray([float(w) for w in weights], dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"dataset weights must be numbers, got {list(weights)!r}.") from None
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"dataset weights must be finite and non-negative, got {list(weights)!r}.")
    total = array.sum()
    if total <= 0:
        raise ValueError(f"dataset weights {list(weights)!r} sum to zero; give at least one positive weight.")
    return array / total


def build_blending_indices(weights: np.ndarray, size: int):
    """For each of ``size`` samples: which dataset, and which sample of it.

    Greedy, as in Megatron: sample ``s`` goes to the dataset furthest behind its target
    count ``weight * s``, ties to the lowest index, so at every prefix each dataset's share
    is within one sample of its weight. Zero-weight datasets are never drawn (upstream's
    tie rule would occasionally draw them).
    """
    num_datasets = len(weights)
    dataset_index = np.empty(size, dtype=np.int16 if num_datasets < 2**15 else np.int32)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    counts = [0] * num_datasets
    active = [d for d in range(num_datasets) if weights[d] > 0]
    w = [float(x) for x in weights]
    for s in range(size):
        t = float(max(s, 1))
        best = active[0]
        best_error = w[best] * t - counts[best]
        for d in active[1:]:
            error = w[d] * t - counts[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[s] = best
        dataset_sample_index[s] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """``size`` samples drawn from ``datasets`` so each one's share tracks its weight.

    The draw is deterministic (no randomness: order within each dataset is already
    shuffled by that dataset). Each dataset must hold at least the samples drawn from it
    (about ``weight * size``, plus one); :func:`megatron.core.datasets.build_gpt_datasets`
    builds each with ``ceil(weight * size * 1.005)``, as Megatron does.
    """

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[float],
        size: int,
        *,
        cache_dir: Optional[str] = None,
        name: str = "blend",
    ):
        if len(datasets) == 0:
            raise ValueError("BlendedDataset needs at least one dataset.")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"BlendedDataset size must be a positive integer, got {size!r}.")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights, len(self.datasets))
        self.size = int(size)
        self.name = check_cache_name(name)

        indices = self._load_or_build(cache_dir)
        self.dataset_index = indices["dataset_index"]
        self.dataset_sample_index = indices["dataset_sample_index"]

        needed = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        for d, (dataset, count) in enumerate(zip(self.datasets, needed)):
            if count > len(dataset):
                raise ValueError(
                    f"blended dataset {name!r} draws {count} samples from dataset {d} "
                    f"(weight {self.weights[d]:.4f}) but it has only {len(dataset)}; build that "
                    "dataset with more samples."
                )

    def _load_or_build(self, cache_dir: Optional[str]) -> Dict[str, np.ndarray]:
        if cache_dir is None:
            dataset_index, dataset_sample_index = build_blending_indices(self.weights, self.size)
            return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}
        description = {
            "class": type(self).__name__,
            "weights": [float(w) for w in self.weights],
            "size": self.size,
            "name": self.name,
            # The blend indices depend only on weights and size, but naming the parts keeps
            # cache entries of different blends apart for humans reading the directory.
            "datasets": [getattr(d, "name", type(d).__name__) for d in self.datasets],
        }
        stem = os.path.join(cache_dir, f"{description_hash(description)}-{type(self).__name__}-{self.name}")
        paths = {
            "dataset_index": f"{stem}-dataset_index.npy",
            "dataset_sample_index": f"{stem}-dataset_sample_index.npy",
        }
        cached = load_cached_arrays(paths)
        if cached is not None:
            return cached
        prepare_cache_dir(cache_dir)
        dataset_index, dataset_sample_index = build_blending_indices(self.weights, self.size)
        atomic_save_npy(paths["dataset_index"], dataset_index)
        atomic_save_npy(paths["dataset_sample_index"], dataset_sample_index)
        atomic_write_text(f"{stem}-description.json", json.dumps(description, indent=2, sort_keys=True))
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not isinstance(idx, (int, np.integer)):
            raise TypeError(f"sample index must be an integer, not {type(idx).__name__}")
        if idx < 0:
            idx += self.size
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blended dataset of {self.size} samples")
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]


class MockGPTDataset:
    """Random tokens in ``[0, vocab_size)`` in GPTDataset's sample format (``--mock-data``).

    Sample ``i`` depends only on ``(seed, i)``, so any worker or rank reproduces it. The
    tokens include ``eod_token`` (the tokenizer's, e.g. NullTokenizer's last id) at random
    places, so the EOD options (``packed_document_fields``) have documents to work on.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, *,
                 eod_token: Optional[int] = None, eod_mask_loss: bool = False, reset_position_ids: bool = False,
                 reset_attention_mask: bool = False):
        for name, value in (("num_samples", num_samples), ("seq_length", seq_length), ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"MockGPTDataset {name} must be a positive integer, got {value!r}.")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}.")
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.vocab_size = int(vocab_size)
        self.seed = int(seed)
        self.name = "mock"
        if (eod_mask_loss or reset_position_ids or reset_attention_mask) and eod_token is None:
            raise ValueError("eod_mask_loss / reset_position_ids / reset_attention_mask need eod_token.")
        self.eod_token = eod_token
        self.document_options = dict(eod_mask_loss=eod_mask_loss, reset_position_ids=reset_position_ids,
                                     reset_attention_mask=reset_attention_mask)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        if not isinstance(idx, (int, np.integer)):
            raise TypeError(f"sample index must be an integer, not {type(idx).__name__}")
        if idx < 0:
            idx += self.num_samples
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for a mock dataset of {self.num_samples} samples")
        rng = np.random.default_rng((self.seed, int(idx)))
        window = rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64)
        sample = {"tokens": window[:-1], "labels": window[1:]}
        sample.update(packed_document_fields(window[:-1], self.eod_token, **self.document_options))
        return sample
