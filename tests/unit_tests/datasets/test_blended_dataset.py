import os

import numpy as np
import pytest

from megatron.core.datasets import BlendedDataset, MockGPTDataset


class Labelled:
    """Sample j of dataset d is (d, j)."""

    def __init__(self, d, n):
        self.d, self.n, self.name = d, n, f"part{d}"

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        if not 0 <= j < self.n:
            raise IndexError(j)
        return (self.d, j)


@pytest.mark.parametrize("weights", [[1, 1], [0.2, 0.8], [3, 1, 6], [0.05, 0.9, 0.05], [1]])
def test_fractions_track_weights(weights):
    size = 2000
    parts = [Labelled(d, size) for d in range(len(weights))]
    blend = BlendedDataset(parts, weights, size)
    target = np.asarray(weights, dtype=float) / sum(weights)
    counts = np.zeros(len(weights))
    seen = [0] * len(weights)
    for i in range(size):
        d, j = blend[i]
        assert j == seen[d]  # each part is consumed in order, without gaps or repeats
        seen[d] += 1
        counts[d] += 1
        # At every prefix, every share stays within two samples of its target (the greedy
        # rule aims at weight * samples-so-far, one step behind).
        assert np.all(np.abs(counts - target * (i + 1)) < 2.0)
    assert np.all(np.abs(counts - target * size) <= 1.0 + 1e-9)
    assert len(blend) == size


def test_deterministic():
    parts = [Labelled(0, 500), Labelled(1, 500)]
    a = BlendedDataset(parts, [0.3, 0.7], 400)
    b = BlendedDataset(parts, [3, 7], 400)
    assert [a[i] for i in range(400)] == [b[i] for i in range(400)]


def test_zero_weight_never_drawn():
    blend = BlendedDataset([Labelled(0, 100), Labelled(1, 100)], [0, 1], 100)
    assert {blend[i][0] for i in range(100)} == {1}


def test_cache(tmp_path):
    parts = [Labelled(0, 500), Labelled(1, 500)]
    a = BlendedDataset(parts, [0.3, 0.7], 400, cache_dir=str(tmp_path), name="train")
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 3
    b = BlendedDataset(parts, [0.3, 0.7], 400, cache_dir=str(tmp_path), name="train")
    assert sorted(os.listdir(tmp_path)) == files
    np.testing.assert_array_equal(a.dataset_index, b.dataset_index)
    assert isinstance(b.dataset_index, np.memmap)


def test_bad_arguments():
    parts = [Labelled(0, 100), Labelled(1, 100)]
    with pytest.raises(ValueError, match="one weight per dataset"):
        BlendedDataset(parts, [1], 10)
    with pytest.raises(ValueError, match="non-negative"):
        BlendedDataset(parts, [1, -1], 10)
    with pytest.raises(ValueError, match="non-negative"):
        BlendedDataset(parts, [1, float("nan")], 10)
    with pytest.raises(ValueError, match="sum to zero"):
        BlendedDataset(parts, [0, 0], 10)
    with pytest.raises(ValueError, match="numbers"):
        BlendedDataset(parts, ["a", 1], 10)
    with pytest.raises(ValueError, match="positive integer"):
        BlendedDataset(parts, [1, 1], 0)
    with pytest.raises(ValueError, match="at least one dataset"):
        BlendedDataset([], [], 10)
    with pytest.raises(ValueError, match="has only 10"):
        BlendedDataset([Labelled(0, 10), Labelled(1, 100)], [0.5, 0.5], 100)
    blend = BlendedDataset(parts, [1, 1], 10)
    with pytest.raises(IndexError):
        blend[10]


def test_mock_dataset():
    ds = MockGPTDataset(num_samples=50, seq_length=16, vocab_size=100, seed=3)
    assert len(ds) == 50
    sample = ds[7]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert sample["tokens"].dtype == np.int64 and sample["tokens"].shape == (16,)
    assert sample["loss_mask"].dtype == np.float32
    np.testing.assert_array_equal(sample["tokens"][1:], sample["labels"][:-1])
    np.testing.assert_array_equal(sample["position_ids"], np.arange(16))
    tokens = np.stack([ds[i]["tokens"] for i in range(50)])
    assert tokens.min() >= 0 and tokens.max() < 100
    np.testing.assert_array_equal(MockGPTDataset(50, 16, 100, 3)[7]["tokens"], sample["tokens"])
    assert not np.array_equal(MockGPTDataset(50, 16, 100, 4)[7]["tokens"], sample["tokens"])
    assert not np.array_equal(ds[8]["tokens"], sample["tokens"])
    with pytest.raises(IndexError):
        ds[50]
    with pytest.raises(ValueError, match="vocab_size"):
        MockGPTDataset(10, 16, 0, 0)
