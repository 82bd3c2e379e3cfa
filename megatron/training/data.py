"""Batch samplers and data iterators (Megatron's pretraining sampler semantics).

Each global batch is ``global_batch_size`` consecutive sample indices; a data-parallel
rank takes its ``micro_batch_size`` slice of every ``micro_batch_size * dp_size`` chunk.
Resuming at ``consumed_samples`` continues exactly where a run stopped.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch.utils.data import DataLoader

from megatron.core.transformer.context_parallel import split_for_context_parallel


class MegatronPretrainingSampler:
    """Yields this rank's micro-batches of indices in order, from ``consumed_samples`` on."""
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if total_samples <= 0:
            raise ValueError(f"the dataset has no samples (total_samples={total_samples}).")
        if consumed_samples >= total_samples:
            raise ValueError(
                f"already consumed {consumed_samples} of {total_samples} samples; the dataset is too "
                "small for --train-iters x --global-batch-size (or the checkpoint is from a longer run)."
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data-parallel rank {data_parallel_rank} is outside [0, {data_parallel_size}).")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.chunk = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.chunk

    def __iter__(self):
        start = self.data_parallel_rank * self.micro_batch_size
        batch = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.chunk:
                yield batch[start : start + self.micro_batch_size]
                batch = []
        # An incomplete last chunk is dropped, so every rank yields the same count.


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  dp_rank: int, dp_size: int, num_workers: int,
                                  pin_memory: bool = False) -> Optional[DataLoader]:
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )


# The per-token entries of a batch ([batch, sequence]) that context parallelism splits
# (document_start: packed documents' DocumentMask, the global position each token's
# document starts at, so that each CP rank holds its queries').
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "document_start")


def split_batch_for_context_parallel(batch: Dict[str, torch.Tensor], cp_size: int, cp_rank: int):
    """This CP rank's tokens of every per-token entry (``SEQUENCE_KEYS``), with their global
    position ids (made from the sequence length when the batch has none)."""
    if cp_size == 1:
        return batch

    if batch.get("attention_mask") is not None:
        raise ValueError("context parallelism builds the causal mask from global positions; the batch's "
                         "attention_mask cannot be split: drop it, or use --context-parallel-size 1.")
    batch = dict(batch)
    if "position_ids" not in batch:
        tokens = batch["tokens"]
        batch["position_ids"] = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    for key in SEQUENCE_KEYS:
        if key in batch:
            batch[key] = split_for_context_parallel(batch[key], cp_size, cp_rank, seq_dim=1)
    return batch


class DeviceIterator:
    """Wraps a loader: every batch dict comes out with its tensors on ``device`` and, under
    context parallelism, cut to this CP rank's tokens. The one place where batches are
    split, so the schedule's token count, the forward step and the loss see the same tokens."""
    def __init__(self, loader: DataLoader, device: torch.device, cp_size: int = 1, cp_rank: int = 0):
        self.loader = loader
        self.device = device
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self._it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        try:
            batch = next(self._it)
        except StopIteration:
            raise RuntimeError(
                "the data iterator ran out of samples; the dataset is smaller than the run needs "
                "(raise the dataset size or lower --train-iters/--eval-iters)."
            ) from None
        non_blocking = self.device.type == "cuda"
        batch = {k: (v.to(self.device, non_blocking=non_blocking) if torch.is_tensor(v) else v)
                 for k, v in batch.items()}
        return split_batch_for_context_parallel(batch, self.cp_size, self.cp_rank)
