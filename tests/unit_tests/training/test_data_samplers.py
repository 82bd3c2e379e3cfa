"""Megatron's pretraining sampler: per-rank slices of consecutive global batches."""

import pytest
import torch

from megatron.training.data import DeviceIterator, MegatronPretrainingSampler, build_pretraining_data_loader


def test_ranks_take_their_slice_of_each_chunk():
    rank0 = list(MegatronPretrainingSampler(17, 0, 2, 0, 2))
    rank1 = list(MegatronPretrainingSampler(17, 0, 2, 1, 2))
    assert rank0 == [[0, 1], [4, 5], [8, 9], [12, 13]]
    assert rank1 == [[2, 3], [6, 7], [10, 11], [14, 15]]  # incomplete last chunk dropped


def test_resume_continues_where_it_stopped():
    full = list(MegatronPretrainingSampler(32, 0, 2, 1, 2))
    resumed = list(MegatronPretrainingSampler(32, 8, 2, 1, 2))
    assert resumed == full[2:]


def test_errors():
    with pytest.raises(ValueError, match="too small"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match="outside"):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)


class _Toy:
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {"tokens": torch.full((3,), i), "loss_mask": torch.ones(3)}


def test_device_iterator_reports_exhaustion_clearly():
    it = DeviceIterator(build_pretraining_data_loader(_Toy(), 0, 2, 0, 1, 0), torch.device("cpu"))
    batches = [next(it) for _ in range(3)]
    assert batches[1]["tokens"].tolist() == [[2, 2, 2], [3, 3, 3]]
    with pytest.raises(RuntimeError, match="ran out of samples"):
        next(it)
