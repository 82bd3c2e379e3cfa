import os

import numpy as np
import pytest

from megatron.core.datasets import GPTDataset, IndexedDataset
from megatron.core.datasets.gpt_dataset import build_document_index, build_sample_index


def megatron_walk_sample_index(sizes, document_index, seq_length):
    """Reference: Megatron's token-by-token walk, transcribed from its description
    (each sample consumes seq_length + 1 tokens; the next starts on the last of them)."""
    total = int(sum(sizes[d] for d in document_index))
    num_samples = (total - 1) // seq_length
    out = [(0, 0)]
    position, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining != 0:
            available = sizes[document_index[position]] - offset
            remaining -= available
            if remaining <= 0:
                offset += remaining + available - 1
                remaining = 0
            else:
                position += 1
                offset = 0
        out.append((position, offset))
    return np.array(out, dtype=np.int64)


def test_sample_index_matches_megatron_walk():
    rng = np.random.default_rng(1)
    for trial in range(100):
        n = int(rng.integers(1, 20))
        sizes = rng.integers(0, 40, size=n)
        sizes[rng.integers(0, n)] = 0  # empty documents are legal
        if sizes.sum() < 2:
            continue
        seq_length = int(rng.integers(1, 30))
        document_index = build_document_index(np.arange(n), int(rng.integers(1, 4)),
                                              np.random.RandomState(trial), False)
        expected = megatron_walk_sample_index(sizes, document_index, seq_length)
        np.testing.assert_array_equal(build_sample_index(sizes, document_index, seq_length), expected)


def expected_windows(ds: GPTDataset, documents):
    """What every sample must hold: consecutive seq_length+1 token windows of the documents
    concatenated in document-index order, served in shuffle-index order."""
    flat = np.concatenate([np.asarray(documents[d], dtype=np.int64) for d in ds.document_index])
    for i in range(len(ds)):
        s = int(ds.shuffle_index[i])
        yield flat[s * ds.seq_length: s * ds.seq_length + ds.seq_length + 1]


def test_windows_hold_exactly_the_right_tokens(labelled_dataset, labelled_documents):
    ds = GPTDataset(labelled_dataset, np.arange(12), 40, 6, seed=5, cache_dir=None, name="train")
    assert len(ds) >= 40
    crossings = 0
    for i, window in enumerate(expected_windows(ds, labelled_documents)):
        sample = ds[i]
        np.testing.assert_array_equal(sample["tokens"], window[:-1])
        np.testing.assert_array_equal(sample["labels"], window[1:])
        crossings += len(set((window // 1000).tolist())) > 1
    assert crossings > 10  # the test really exercises document boundaries


def test_sample_format(labelled_dataset):
    ds = GPTDataset(labelled_dataset, np.arange(12), 10, 8, seed=0, cache_dir=None, name="train")
    sample = ds[3]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
    for key in ("tokens", "labels", "position_ids"):
        assert sample[key].dtype == np.int64 and sample[key].shape == (8,)
    assert sample["loss_mask"].dtype == np.float32 and sample["loss_mask"].shape == (8,)
    np.testing.assert_array_equal(sample["tokens"][1:], sample["labels"][:-1])
    np.testing.assert_array_equal(sample["position_ids"], np.arange(8))
    np.testing.assert_array_equal(sample["loss_mask"], np.ones(8))
    np.testing.assert_array_equal(ds[-1]["tokens"], ds[len(ds) - 1]["tokens"])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_split_documents_only(labelled_dataset, labelled_documents):
    docs = np.array([2, 5, 9])
    ds = GPTDataset(labelled_dataset, docs, 20, 5, seed=1, cache_dir=None, name="valid")
    assert set(np.unique(ds.document_index).tolist()) == {2, 5, 9}
    for i in range(len(ds)):
        assert set((ds.get_window(i) // 1000).tolist()) <= {2, 5, 9}


def test_epochs_cover_requested_samples(labelled_dataset):
    tokens = sum(int(labelled_dataset.sequence_lengths[d]) for d in range(12))  # 94
    ds = GPTDataset(labelled_dataset, np.arange(12), 100, 4, seed=3, cache_dir=None, name="train")
    epochs = -(-(100 * 4 + 1) // tokens)
    assert len(ds.document_index) == 12 * epochs
    np.testing.assert_array_equal(np.bincount(ds.document_index, minlength=12), np.full(12, epochs))
    assert len(ds) >= 100
    # One epoch when num_samples is None.
    one = GPTDataset(labelled_dataset, np.arange(12), None, 4, seed=3, cache_dir=None, name="valid")
    assert len(one) == (tokens - 1) // 4


def test_separate_final_epoch_is_its_own_permutation(labelled_dataset):
    # 94 tokens/epoch, seq 4 -> 23 samples/epoch; 25 samples need 2 epochs but use only 2 of the
    # second epoch's 23 samples (< 80%), so Megatron shuffles the last epoch separately.
    ds = GPTDataset(labelled_dataset, np.arange(12), 25, 4, seed=3, cache_dir=None, name="train")
    assert sorted(ds.document_index[:12].tolist()) == list(range(12))
    assert sorted(ds.document_index[12:].tolist()) == list(range(12))
    first_epoch_samples = (94 - 1) // 4
    assert set(ds.shuffle_index[:first_epoch_samples].tolist()) == set(range(first_epoch_samples))


def test_seed_determinism(labelled_dataset):
    def samples(seed):
        ds = GPTDataset(labelled_dataset, np.arange(12), 30, 5, seed=seed, cache_dir=None, name="train")
        return np.stack([ds[i]["tokens"] for i in range(len(ds))])

    np.testing.assert_array_equal(samples(7), samples(7))
    a, b = samples(7), samples(8)
    assert a.shape == b.shape and not np.array_equal(a, b)


def test_eod_mask_loss(write_dataset):
    eod = 99
    prefix = write_dataset([[1, 2, 3, eod], [4, 5, eod], [6, 7, 8, 9, eod]])
    ds = GPTDataset(IndexedDataset(prefix), np.arange(3), 5, 4, seed=0, cache_dir=None, name="train",
                    eod_mask_loss=True, eod_token=eod)
    plain = GPTDataset(IndexedDataset(prefix), np.arange(3), 5, 4, seed=0, cache_dir=None, name="train")
    masked_somewhere = False
    for i in range(len(ds)):
        sample = ds[i]
        np.testing.assert_array_equal(sample["loss_mask"], (sample["tokens"] != eod).astype(np.float32))
        np.testing.assert_array_equal(plain[i]["loss_mask"], np.ones(4, dtype=np.float32))
        masked_somewhere |= bool((sample["loss_mask"] == 0).any())
    assert masked_somewhere


def test_reset_position_ids_and_attention_mask(write_dataset):
    """Positions restart after each EOD; document_start is each token's document's first
    position in the sample (the window may begin inside a document: its start is 0)."""
    eod = 99
    prefix = write_dataset([[1, 2, 3, eod], [4, 5, eod], [6, 7, 8, 9, eod]])
    ds = GPTDataset(IndexedDataset(prefix), np.arange(3), 5, 6, seed=0, cache_dir=None, name="train",
                    eod_token=eod, reset_position_ids=True, reset_attention_mask=True)
    for i in range(len(ds)):
        sample = ds[i]
        tokens, expected_start = sample["tokens"], []
        for j in range(len(tokens)):
            previous_eods = [k for k in range(j) if tokens[k] == eod]
            expected_start.append(previous_eods[-1] + 1 if previous_eods else 0)
        np.testing.assert_array_equal(sample["document_start"], expected_start)
        np.testing.assert_array_equal(sample["position_ids"], np.arange(len(tokens)) - np.array(expected_start))
    positions_only = GPTDataset(IndexedDataset(prefix), np.arange(3), 5, 6, seed=0, cache_dir=None, name="train",
                                eod_token=eod, reset_position_ids=True)
    assert "document_start" not in positions_only[0]
    with pytest.raises(ValueError, match="need eod_token"):
        GPTDataset(IndexedDataset(prefix), np.arange(3), 5, 6, seed=0, cache_dir=None, name="train",
                   reset_attention_mask=True)


def test_cache_is_reused_and_keyed(tmp_path, labelled_dataset):
    cache = tmp_path / "cache"
    first = GPTDataset(labelled_dataset, np.arange(12), 30, 5, seed=1, cache_dir=str(cache), name="train")
    assert not first.loaded_from_cache
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and not any(".tmp" in f for f in files)
    second = GPTDataset(labelled_dataset, np.arange(12), 30, 5, seed=1, cache_dir=str(cache), name="train")
    assert second.loaded_from_cache
    for key in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(first, key), getattr(second, key))
    np.testing.assert_array_equal(first[4]["tokens"], second[4]["tokens"])
    # Any parameter change is a different cache entry.
    other = GPTDataset(labelled_dataset, np.arange(12), 30, 5, seed=2, cache_dir=str(cache), name="train")
    assert not other.loaded_from_cache
    assert len(os.listdir(cache)) == 8


def test_cache_invalidated_when_data_changes(tmp_path, write_dataset):
    cache = str(tmp_path / "cache")
    prefix = write_dataset([[1] * 10, [2] * 10, [3] * 10], name="corpus")
    GPTDataset(IndexedDataset(prefix), np.arange(3), 5, 4, seed=0, cache_dir=cache, name="train")
    # Re-preprocess the same prefix with different documents.
    prefix = write_dataset([[1] * 3, [2] * 30, [3] * 4], name="corpus")
    ds = GPTDataset(IndexedDataset(prefix), np.arange(3), 5, 4, seed=0, cache_dir=cache, name="train")
    assert not ds.loaded_from_cache
    for i in range(len(ds)):
        ds[i]


def test_bad_arguments(tmp_path, labelled_dataset, write_dataset):
    ok = dict(num_samples=10, seq_length=4, seed=0, cache_dir=None, name="train")
    with pytest.raises(ValueError, match="no documents"):
        GPTDataset(labelled_dataset, np.array([], dtype=np.int64), **ok)
    with pytest.raises(ValueError, match="must lie in"):
        GPTDataset(labelled_dataset, np.array([0, 12]), **ok)
    with pytest.raises(ValueError, match="eod_token"):
        GPTDataset(labelled_dataset, np.arange(3), **ok, eod_mask_loss=True)
    with pytest.raises(ValueError, match="seq_length"):
        GPTDataset(labelled_dataset, np.arange(3), **{**ok, "seq_length": 0})
    with pytest.raises(ValueError, match="num_samples"):
        GPTDataset(labelled_dataset, np.arange(3), **{**ok, "num_samples": -1})
    with pytest.raises(ValueError, match="seed"):
        GPTDataset(labelled_dataset, np.arange(3), **{**ok, "seed": -1})
    with pytest.raises(ValueError, match="name"):
        GPTDataset(labelled_dataset, np.arange(3), **{**ok, "name": "../x"})
    tiny = IndexedDataset(write_dataset([[1, 2], [3]], name="tiny"))
    with pytest.raises(ValueError, match="fewer than one sample"):
        GPTDataset(tiny, np.arange(2), None, 8, 0, None, "valid")
    with pytest.raises(ValueError, match="too few"):
        GPTDataset(IndexedDataset(write_dataset([[1], []], name="one")), np.arange(2), 3, 8, 0, None, "v")


def test_incomplete_or_corrupt_cache_is_rebuilt(tmp_path, labelled_dataset):
    cache = tmp_path / "cache"
    first = GPTDataset(labelled_dataset, np.arange(12), 30, 5, seed=1, cache_dir=str(cache), name="train")
    expected = [first[i]["tokens"] for i in range(len(first))]
    # A crashed writer can leave a set without one file, or another tool a damaged file.
    os.remove(first.cache_paths["shuffle_index"])
    with open(first.cache_paths["sample_index"], "wb") as f:
        f.write(b"garbage")
    again = GPTDataset(labelled_dataset, np.arange(12), 30, 5, seed=1, cache_dir=str(cache), name="train")
    assert not again.loaded_from_cache
    for i, tokens in enumerate(expected):
        np.testing.assert_array_equal(again[i]["tokens"], tokens)


def test_pickle_sends_cache_paths_not_arrays(tmp_path, labelled_dataset):
    import pickle

    cached = GPTDataset(labelled_dataset, np.arange(12), 2000, 5, seed=1, cache_dir=str(tmp_path), name="train")
    in_memory = GPTDataset(labelled_dataset, np.arange(12), 2000, 5, seed=1, cache_dir=None, name="train")
    blob = pickle.dumps(cached)
    assert len(blob) < len(pickle.dumps(in_memory)) / 4
    clone = pickle.loads(blob)
    for i in (0, 17, len(cached) - 1):
        np.testing.assert_array_equal(clone[i]["tokens"], in_memory[i]["tokens"])


def _build_in_child(prefix, cache, queue):
    ds = GPTDataset(IndexedDataset(prefix), np.arange(12), 500, 5, seed=9, cache_dir=cache, name="train")
    queue.put(np.stack([ds[i]["tokens"] for i in range(len(ds))]).tobytes())


def test_concurrent_builders_share_one_cache(tmp_path, write_dataset, labelled_documents):
    import multiprocessing

    prefix = write_dataset(labelled_documents)
    cache = str(tmp_path / "cache")
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(prefix, cache, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(set(results)) == 1
    assert not any(".tmp" in f for f in os.listdir(cache))
    ds = GPTDataset(IndexedDataset(prefix), np.arange(12), 500, 5, seed=9, cache_dir=cache, name="train")
    assert ds.loaded_from_cache
