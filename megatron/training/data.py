"""Batch samplers and data iterators (Megatron's pretraining sampler semantics).

Each global batch is ``global_batch_size`` consecutive sample indices; a data-parallel
rank takes its ``micro_batch_size`` slice of every ``micro_batch_size * dp_size`` chunk.
Resuming at ``consumed_samples`` continues exactly where a run stopped.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch.utils.data import DataLoader


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


class DeviceIterator:
    """Wraps a loader: every batch dict comes out with its tensors on ``device``."""

    def __init__(self, loader: DataLoader, device: torch.device):
        self.loader = loader
        self.device = device
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
        return {k: (v.to(self.device, non_blocking=non_blocking) if torch.is_tensor(v) else v)
                for k, v in batch.items()}
