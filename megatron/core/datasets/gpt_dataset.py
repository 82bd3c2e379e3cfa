"""GPT pretraining samples drawn from an indexed dataset, with Megatron's three indices.

A sample is a window of ``seq_length + 1`` consecutive tokens of the (shuffled)
concatenation of the split's documents; windows run across document boundaries and
consecutive windows share one token (the last label of sample ``i`` is the first token of
sample ``i + 1``). Three indices, all derived from the seed, make this deterministic:

- document index: the split's document ids repeated for enough epochs, shuffled;
- sample index ``[num_samples + 1, 2]``: (position in the document index, token offset)
  where each window starts; window ``i`` ends at entry ``i + 1`` (inclusive);
- shuffle index: the order in which windows are served.

They match upstream Megatron-LM's indices value for value for the same inputs and seed
(same RandomState call sequence, same epoch/final-epoch rules), and are cached as
``.npy`` files keyed by a hash of everything they depend on.
"""

import json
import logging
import os
import time
from typing import Dict, Optional

import numpy as np

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import (
    array_digest,
    atomic_save_npy,
    atomic_write_text,
    check_cache_name,
    description_hash,
    load_cached_arrays,
    prepare_cache_dir,
)

logger = logging.getLogger(__name__)

# Each window holds one token more than the model sees: inputs are [:-1], labels [1:].
_EXTRA_TOKEN = 1
# Megatron shuffles the last epoch on its own when fewer than this fraction of its samples
# are used, so a partial final epoch is a random subset rather than a biased prefix.
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
# Bump when the index construction changes, so stale caches are not reused.
_INDEX_FORMAT_VERSION = 1


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: Optional[int]) -> int:
    """Fewest epochs whose tokens yield ``num_samples`` windows (1 when num_samples is None)."""
    if num_samples is None:
        return 1
    tokens_needed = num_samples * seq_length + _EXTRA_TOKEN
    return max(1, -(-tokens_needed // tokens_per_epoch))


def build_document_index(
    document_ids: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """``document_ids`` repeated ``num_epochs`` times and shuffled (int32)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(document_ids, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(document_ids, num_epochs - 1, rng, False)
    last = build_document_index(document_ids, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int
) -> np.ndarray:
    """Start (document-index position, offset) of every window, plus the end of the last.

    Window ``i`` starts at token ``i * seq_length`` of the concatenated document index, so
    the entry is found by a binary search over document start positions instead of
    Megatron's token-by-token walk (same values, including around empty documents: the
    search lands on the document that actually holds the token).
    """
    lengths = np.asarray(sequence_lengths, dtype=np.int64)[document_index]
    total_tokens = int(lengths.sum())
    num_samples = (total_tokens - _EXTRA_TOKEN) // seq_length
    if num_samples < 1:
        return np.zeros((1, 2), dtype=np.int64)
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    positions = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    doc_positions = np.searchsorted(starts, positions, side="right") - 1
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int64)
    sample_index[0] = (0, 0)
    sample_index[1:, 0] = doc_positions
    sample_index[1:, 1] = positions - starts[doc_positions]
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of ``[0, total_size)``: the first ``num_samples`` entries shuffled
    among themselves, the rest (a separately shuffled final epoch) among themselves."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


class GPTDataset:
    """Map-style dataset of GPT samples over ``document_ids`` of ``indexed_dataset``.

    Args:
        indexed_dataset: the tokens.
        document_ids: the split's documents, as sequence ids of ``indexed_dataset`` (GPT
            preprocessing writes one sequence per document; like Megatron, GPT works on
            sequences).
        num_samples: samples wanted; epochs are added until there are at least this many
            (``len()`` may be larger: the whole last epoch is indexed, as in Megatron).
            None means exactly one epoch.
        seq_length: tokens per sample (the window holds one more, for the labels).
        seed: seeds the document and sample shuffles.
        cache_dir: where the indices are cached (None: build in memory every time).
        name: label used in log lines and cache file names (e.g. "train").
        eod_mask_loss: zero the loss where the *input* token is EOD, i.e. do not train the
            prediction of a new document's first token from the previous document
            (Megatron's rule). Needs ``eod_token``.
        eod_token: the tokenizer's EOD id.
        reset_position_ids, reset_attention_mask: packed documents (``packed_document_fields``);
            need ``eod_token``.

    ``dataset[i]`` is a dict of numpy arrays: ``tokens`` int64 [seq], ``labels`` int64 [seq]
    (tokens shifted by one), ``loss_mask`` float32 [seq], ``position_ids`` int64 [seq], and
    with ``reset_attention_mask`` ``document_start`` int64 [seq].
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        document_ids,
        num_samples: Optional[int],
        seq_length: int,
        seed: int,
        cache_dir: Optional[str],
        name: str,
        *,
        eod_mask_loss: bool = False,
        eod_token: Optional[int] = None,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        fim=None,
    ):
        self.indexed_dataset = indexed_dataset
        self.fim = fim
        self.name = check_cache_name(name)
        self.seq_length = _positive_int("seq_length", seq_length)
        if num_samples is not None:
            if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 0:
                raise ValueError(
                    f"num_samples for the {name} dataset must be a non-negative integer or None, "
                    f"got {num_samples!r}."
                )
            num_samples = int(num_samples)
        self.num_samples = num_samples
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}.")
        self.seed = int(seed)
        if eod_mask_loss and eod_token is None:
            raise ValueError(
                "eod_mask_loss needs eod_token (the tokenizer's EOD id) to know which tokens to mask."
            )
        if (reset_position_ids or reset_attention_mask) and eod_token is None:
            raise ValueError("reset_position_ids / reset_attention_mask need eod_token (the tokenizer's EOD id) "
                             "to find where documents end.")
        self.eod_mask_loss = bool(eod_mask_loss)
        self.eod_token = None if eod_token is None else int(eod_token)
        self.reset_position_ids = bool(reset_position_ids)
        self.reset_attention_mask = bool(reset_attention_mask)

        document_ids = np.asarray(document_ids)
        if document_ids.ndim != 1 or document_ids.size == 0:
            raise ValueError(
                f"the {name} dataset has no documents; give it a non-empty 1-D list of document ids "
                "(check --split)."
            )
        if not np.issubdtype(document_ids.dtype, np.integer):
            raise ValueError(f"document ids must be integers, got dtype {document_ids.dtype}.")
        num_sequences = len(indexed_dataset)
        if document_ids.min() < 0 or document_ids.max() >= num_sequences:
            raise ValueError(
                f"document ids for the {name} dataset must lie in [0, {num_sequences}) for "
                f"{indexed_dataset.path_prefix}; got {int(document_ids.min())}..{int(document_ids.max())}."
            )
        if num_sequences >= np.iinfo(np.int32).max:
            raise ValueError("more than 2**31-1 documents in one prefix; shard the dataset.")
        self.document_ids = document_ids.astype(np.int64)

        self.tokens_per_epoch = int(
            np.asarray(indexed_dataset.sequence_lengths, dtype=np.int64)[self.document_ids].sum()
        )
        if self.tokens_per_epoch <= _EXTRA_TOKEN:
            raise ValueError(
                f"the {name} split of {indexed_dataset.path_prefix} holds {self.tokens_per_epoch} "
                "tokens, too few for even one sample; give it more documents (check --split)."
            )

        self.cache_paths: Optional[Dict[str, str]] = None
        self.loaded_from_cache = False
        indices = self._load_or_build_indices(cache_dir)
        self.document_index = indices["document_index"]
        self.sample_index = indices["sample_index"]
        self.shuffle_index = indices["shuffle_index"]
        if len(self.sample_index) < 2:
            raise ValueError(
                f"the {name} split of {indexed_dataset.path_prefix} has {self.tokens_per_epoch} tokens, "
                f"fewer than one sample of seq_length+1 = {self.seq_length + 1}; use more documents "
                "or a shorter --seq-length."
            )

    # ----------------------------------------------------------------------------------
    # indices

    def _description(self) -> Dict:
        lengths = np.asarray(self.indexed_dataset.sequence_lengths)[self.document_ids]
        return {
            "class": type(self).__name__,
            "index_format_version": _INDEX_FORMAT_VERSION,
            "path_prefix": os.path.abspath(self.indexed_dataset.path_prefix),
            "document_ids_md5": array_digest(self.document_ids),
            # The lengths pin the data itself: re-preprocessing a prefix with different text
            # changes them and so invalidates the cache instead of reusing stale windows.
            "document_lengths_md5": array_digest(lengths.astype(np.int64)),
            "num_samples": self.num_samples,
            "seq_length": self.seq_length,
            "seed": self.seed,
            "name": self.name,
        }

    def _build_indices(self) -> Dict[str, np.ndarray]:
        num_epochs = num_epochs_needed(self.tokens_per_epoch, self.seq_length, self.num_samples)
        separate_final_epoch = False
        if num_epochs > 1:
            samples_before_final_epoch = (
                (num_epochs - 1) * self.tokens_per_epoch - _EXTRA_TOKEN
            ) // self.seq_length
            samples_from_final_epoch = self.num_samples - samples_before_final_epoch
            samples_per_epoch = (self.tokens_per_epoch - _EXTRA_TOKEN) // self.seq_length
            separate_final_epoch = samples_from_final_epoch < int(
                _SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch
            )
        # RandomState (not Generator): its stream is frozen across numpy versions, so the
        # same seed gives the same data order everywhere, and it is what Megatron uses.
        rng = np.random.RandomState(self.seed)
        document_index = build_document_index(self.document_ids, num_epochs, rng, separate_final_epoch)
        sample_index = build_sample_index(
            self.indexed_dataset.sequence_lengths, document_index, self.seq_length
        )
        total = len(sample_index) - 1
        if separate_final_epoch:
            shuffle_index = build_shuffle_index(samples_before_final_epoch, total, rng)
        else:
            shuffle_index = build_shuffle_index(total, total, rng)
        return {
            "document_index": document_index,
            "sample_index": sample_index,
            "shuffle_index": shuffle_index,
        }

    def _load_or_build_indices(self, cache_dir: Optional[str]) -> Dict[str, np.ndarray]:
        if cache_dir is None:
            return self._build_indices()
        description = self._description()
        key = description_hash(description)
        stem = os.path.join(cache_dir, f"{key}-{type(self).__name__}-{self.name}")
        paths = {
            "document_index": f"{stem}-document_index.npy",
            "sample_index": f"{stem}-sample_index.npy",
            "shuffle_index": f"{stem}-shuffle_index.npy",
        }
        self.cache_paths = paths
        cached = load_cached_arrays(paths)
        if cached is not None:
            self.loaded_from_cache = True
            logger.info("%s: loaded indices from %s-*.npy", self.name, stem)
            return cached
        self.loaded_from_cache = False
        prepare_cache_dir(cache_dir)
        start = time.perf_counter()
        indices = self._build_indices()
        for key_name, path in paths.items():
            atomic_save_npy(path, indices[key_name])
        atomic_write_text(f"{stem}-description.json", json.dumps(description, indent=2, sort_keys=True))
        logger.info(
            "%s: built indices for %d samples in %.2fs, cached under %s-*.npy",
            self.name, len(indices["sample_index"]) - 1, time.perf_counter() - start, stem,
        )
        return indices

    # DataLoader workers started with spawn receive the dataset by pickle: send the cache
    # paths rather than copies of the (possibly large) index arrays, and map them again.
    def __getstate__(self):
        state = self.__dict__.copy()
        if self.cache_paths is not None:
            for key in self.cache_paths:
                state[key] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.cache_paths is not None:
            loaded = load_cached_arrays(self.cache_paths)
            if loaded is None:
                raise FileNotFoundError(
                    f"the {self.name} dataset's cached indices {sorted(self.cache_paths.values())} "
                    "disappeared; keep the dataset cache directory while training."
                )
            for key, array in loaded.items():
                setattr(self, key, array)

    # ----------------------------------------------------------------------------------
    # samples

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def get_window(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``idx`` (after shuffling), as int64."""
        n = len(self)
        if not isinstance(idx, (int, np.integer)):
            raise TypeError(f"sample index must be an integer, not {type(idx).__name__}")
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sample {idx} out of range for the {self.name} dataset of {n} samples")
        sample = int(self.shuffle_index[idx])
        begin_position, begin_offset = (int(v) for v in self.sample_index[sample])
        end_position, end_offset = (int(v) for v in self.sample_index[sample + 1])
        get = self.indexed_dataset.get
        if begin_position == end_position:
            parts = [
                get(int(self.document_index[begin_position]), begin_offset,
                    end_offset - begin_offset + _EXTRA_TOKEN)
            ]
        else:
            parts = [get(int(self.document_index[begin_position]), begin_offset)]
            for position in range(begin_position + 1, end_position):
                parts.append(get(int(self.document_index[position])))
            parts.append(get(int(self.document_index[end_position]), 0, end_offset + _EXTRA_TOKEN))
        window = np.concatenate(parts).astype(np.int64)
        if window.size != self.seq_length + _EXTRA_TOKEN:
            raise RuntimeError(
                f"sample {idx} of the {self.name} dataset has {window.size} tokens instead of "
                f"{self.seq_length + 1}; the cached indices do not match the data. Delete the cache "
                "directory and rerun."
            )
        return window

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        window = self.get_window(idx)
        if self.fim is not None:
            window = self.fim(window, self.fim.rng(self.seed, self.name, idx % len(self)))
        tokens = window[:-1]
        sample = {"tokens": tokens, "labels": window[1:]}
        sample.update(packed_document_fields(tokens, self.eod_token, eod_mask_loss=self.eod_mask_loss,
                                             reset_position_ids=self.reset_position_ids,
                                             reset_attention_mask=self.reset_attention_mask))
        return sample


def packed_document_fields(tokens: np.ndarray, eod_token: Optional[int], *, eod_mask_loss: bool = False,
                           reset_position_ids: bool = False, reset_attention_mask: bool = False
                           ) -> Dict[str, np.ndarray]:
    """``loss_mask``, ``position_ids`` (and ``document_start``) of one sample's input
    ``tokens`` [seq]: upstream's ``_get_ltor_masks_and_position_ids`` without its dense
    [seq, seq] mask. A document ends with its EOD token, the next starts after it.

    - ``eod_mask_loss``: loss mask 0 where the input token is EOD;
    - ``reset_position_ids``: positions restart at 0 after each EOD;
    - ``reset_attention_mask``: ``document_start``, per token the position of its
      document's first token in the sample (``DocumentMask`` in
      megatron/core/transformer/document_mask.py keeps attention inside documents).
    """
    seq = tokens.shape[0]
    positions = np.arange(seq, dtype=np.int64)
    loss_mask = np.ones(seq, dtype=np.float32)
    fields = {"loss_mask": loss_mask, "position_ids": positions}
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    if reset_position_ids or reset_attention_mask:
        # A token after an EOD at position i starts a document at i + 1; every token
        # belongs to the latest start at or before it.
        starts = np.zeros(seq, dtype=np.int64)
        starts[1:] = np.where(tokens[:-1] == eod_token, positions[1:], 0)
        starts = np.maximum.accumulate(starts)
        if reset_position_ids:
            fields["position_ids"] = positions - starts
        if reset_attention_mask:
            fields["document_start"] = starts
    return fields


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)
