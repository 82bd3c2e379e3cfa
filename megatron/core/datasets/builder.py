"""``build_gpt_datasets``: Megatron's ``--data-path`` / ``--split`` to train/valid/test datasets."""

import math
import os
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from megatron.core.datasets.blended_dataset import BlendedDataset, normalize_weights
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path
from megatron.core.datasets.utils import SPLIT_NAMES, parse_split, split_boundaries

# Each blended part gets a little more than its share, as in Megatron, so the greedy blend
# (which can run one sample ahead of a weight) never asks a part for a sample it lacks.
_BLEND_MARGIN = 1.005

_DATA_PATH_HELP = (
    "--data-path takes one prefix ('data/corpus_text_document') or weight/prefix pairs "
    "('0.3 data/a_text_document 0.7 data/b_text_document')"
)


def parse_data_path(data_path: Union[str, Sequence[str]]) -> Tuple[List[str], Optional[List[float]]]:
    """(prefixes, weights) from Megatron's list form; weights is None for a single prefix."""
    if isinstance(data_path, str):
        data_path = data_path.split()
    items = [str(x) for x in data_path]
    if len(items) == 0:
        raise ValueError(f"--data-path is empty. {_DATA_PATH_HELP}.")
    if len(items) == 1:
        return items, None
    if len(items) % 2 != 0:
        raise ValueError(
            f"--data-path has {len(items)} entries, an odd number, so they cannot be weight/prefix "
            f"pairs. {_DATA_PATH_HELP}."
        )
    weights, prefixes = [], []
    for weight, prefix in zip(items[0::2], items[1::2]):
        try:
            weights.append(float(weight))
        except ValueError:
            raise ValueError(f"--data-path weight {weight!r} is not a number. {_DATA_PATH_HELP}.") from None
        prefixes.append(prefix)
    normalize_weights(weights, len(prefixes))  # validates: finite, >= 0, positive sum
    return prefixes, weights


def _open_prefix(prefix: str, mmap_bin_files: bool = True) -> IndexedDataset:
    bin_path, idx_path = get_bin_path(prefix), get_idx_path(prefix)
    if not (os.path.isfile(bin_path) and os.path.isfile(idx_path)):
        hint = ""
        if prefix.endswith((".bin", ".idx")):
            hint = f" Drop the extension: pass {prefix[:-4]!r}."
        raise FileNotFoundError(
            f"--data-path prefix {prefix!r} has no dataset: expected {bin_path} and {idx_path}. "
            f"Create them with tools/preprocess_data.py (or tools/prepare_shakespeare.py).{hint}"
        )
    return IndexedDataset(prefix, mmap_bin_files=mmap_bin_files)


def _check_num_samples(train_valid_test_num_samples) -> List[Optional[int]]:
    values = list(train_valid_test_num_samples)
    if len(values) != 3:
        raise ValueError(
            f"train_valid_test_num_samples needs three entries (train, valid, test), got {values!r}."
        )
    for value in values:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0
        ):
            raise ValueError(
                f"sample counts must be non-negative integers or None (one epoch), got {values!r}."
            )
    return [None if v is None else int(v) for v in values]


def build_gpt_datasets(
    data_path: Union[str, Sequence[str]],
    split: str,
    train_valid_test_num_samples: Sequence[Optional[int]],
    seq_length: int,
    seed: int,
    cache_dir: Optional[str],
    eod_mask_loss: bool = False,
    *,
    eod_token: Optional[int] = None,
    mmap_bin_files: bool = True,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    fim=None,
):
    """(train, valid, test) datasets; an entry is None when its split has no documents or
    zero samples are asked of it.

    ``split`` divides each prefix's documents into contiguous train/valid/test ranges
    (Megatron's rule). With several prefixes, each split is a :class:`BlendedDataset` of
    the prefixes' datasets for that split, weighted as in ``data_path``. A sample count of
    None means one epoch (single prefix only). ``eod_token`` is needed with ``eod_mask_loss``,
    ``reset_position_ids`` and ``reset_attention_mask`` (packed documents, as GPTDataset).
    ``mmap_bin_files=False`` reads the .bin files without memory maps. ``fim`` (a
    ``FIMTransform``) turns every sample into fill-in-the-middle form (``--fim-data``).
    """
    prefixes, weights = parse_data_path(data_path)
    fractions = parse_split(split)
    num_samples = _check_num_samples(train_valid_test_num_samples)
    if eod_mask_loss and eod_token is None:
        raise ValueError("eod_mask_loss needs eod_token (the tokenizer's EOD id).")
    # Open every prefix before building anything, so a typo in the last one fails fast.
    indexed = [_open_prefix(p, mmap_bin_files) for p in prefixes]
    boundaries = [split_boundaries(fractions, len(ds)) for ds in indexed]

    results = []
    for i, split_name in enumerate(SPLIT_NAMES):
        requested = num_samples[i]
        ranges = [(b[i], b[i + 1]) for b in boundaries]
        empty = [p for p, (lo, hi) in zip(prefixes, ranges) if hi <= lo]
        if requested == 0 or len(empty) == len(prefixes):
            results.append(None)
            continue
        if empty:
            raise ValueError(
                f"the {split_name} split is empty for {', '.join(empty)} (--split {split!r}) but not "
                "for the other prefixes; give those prefixes more documents or change --split."
            )

        def make(ds: IndexedDataset, lo: int, hi: int, count: Optional[int]) -> GPTDataset:
            return GPTDataset(
                ds, np.arange(lo, hi, dtype=np.int64), count, seq_length, seed, cache_dir,
                split_name, eod_mask_loss=eod_mask_loss, eod_token=eod_token,
                reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
                fim=fim,
            )

        if weights is None:
            lo, hi = ranges[0]
            results.append(make(indexed[0], lo, hi, requested))
            continue
        if requested is None:
            raise ValueError(
                f"blending several prefixes needs a sample count for the {split_name} split, not None."
            )
        normalized = normalize_weights(weights, len(prefixes))
        parts = [
            make(ds, lo, hi, int(math.ceil(w * requested * _BLEND_MARGIN)))
            for ds, (lo, hi), w in zip(indexed, ranges, normalized)
        ]
        results.append(BlendedDataset(parts, normalized, requested, cache_dir=cache_dir, name=split_name))
    return tuple(results)
