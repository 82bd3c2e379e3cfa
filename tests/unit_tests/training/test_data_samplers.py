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


class _Sequences(torch.utils.data.Dataset):
    """Sample i: tokens i*100 + position over 8 positions (labels +1), no position ids."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        tokens = torch.arange(8) + 100 * i
        return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(8), "index": i}


def test_device_iterator_keeps_this_cp_ranks_tokens_and_their_global_positions():
    loader = build_pretraining_data_loader(_Sequences(), 0, 2, 0, 1, 0)
    # CP = 2: chunks of 2 tokens; rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2.
    for cp_rank, positions in ((0, [0, 1, 6, 7]), (1, [2, 3, 4, 5])):
        batch = next(DeviceIterator(loader, torch.device("cpu"), cp_size=2, cp_rank=cp_rank))
        assert batch["position_ids"].tolist() == [positions, positions]
        assert batch["tokens"].tolist() == [positions, [100 + p for p in positions]]
        assert batch["labels"].tolist() == [[p + 1 for p in positions], [101 + p for p in positions]]
        assert batch["loss_mask"].shape == (2, 4) and batch["index"].tolist() == [0, 1]  # other entries kept


def test_cp_split_refuses_an_attention_mask():
    from megatron.training.data import split_batch_for_context_parallel

    batch = {"tokens": torch.zeros(1, 8, dtype=torch.long), "attention_mask": torch.ones(1, 1, 8, 8, dtype=torch.bool)}
    with pytest.raises(ValueError, match="the batch's attention_mask cannot be split: drop it, or use "
                                         "--context-parallel-size 1"):
        split_batch_for_context_parallel(batch, 2, 0)
    assert split_batch_for_context_parallel(batch, 1, 0) is batch  # CP = 1: untouched
