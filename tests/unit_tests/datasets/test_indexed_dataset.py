import os
import pickle
import struct

import numpy as np
import pytest

from megatron.core.datasets import IndexedDataset, IndexedDatasetBuilder, optimal_dtype
from megatron.core.datasets.indexed_dataset import dtype_code

# Megatron's dtype code table, restated here so that a change in the module fails the test.
MEGATRON_DTYPE_CODES = {
    np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4,
    np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8,
}

# The .idx that upstream Megatron-LM's IndexedDatasetBuilder writes (captured from it) for
# uint16 documents [[1, 2, 3]] and [[4, 5], [6]] (second document: two sequences).
UPSTREAM_IDX_HEX = (
    "4d4d494449445800000100000000000000080300000000000000030000000000000003000000020000"
    "0001000000000000000000000006000000000000000a000000000000000000000000000000010000"
    "00000000000300000000000000"
)


def reference_write(prefix, documents, dtype):
    """Independent writer straight from the documented layout (documents = lists of sequences)."""
    dtype = np.dtype(dtype)
    lengths, pointers, doc_index, payload = [], [], [0], b""
    for document in documents:
        for sequence in document:
            pointers.append(len(payload))
            lengths.append(len(sequence))
            payload += np.asarray(sequence, dtype=dtype).tobytes()
        doc_index.append(len(lengths))
    with open(prefix + ".bin", "wb") as f:
        f.write(payload)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", MEGATRON_DTYPE_CODES[dtype.type]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_index)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_index)}q", *doc_index))


def build(prefix, documents, dtype):
    with IndexedDatasetBuilder(prefix + ".bin", dtype=dtype) as builder:
        for document in documents:
            for sequence in document:
                builder.add_item(sequence)
            builder.end_document()
        builder.finalize(prefix + ".idx")


DOCUMENTS = [[[1, 2, 3]], [[4, 5], [6]], [[]], [[7] * 10, [8, 9]], [[100]]]


@pytest.mark.parametrize("dtype", list(MEGATRON_DTYPE_CODES))
def test_round_trip_and_bytes_match_reference(tmp_path, dtype):
    ours, ref = str(tmp_path / "ours"), str(tmp_path / "ref")
    build(ours, DOCUMENTS, dtype)
    reference_write(ref, DOCUMENTS, dtype)
    for suffix in (".bin", ".idx"):
        with open(ours + suffix, "rb") as a, open(ref + suffix, "rb") as b:
            assert a.read() == b.read(), suffix
    for prefix in (ours, ref):
        ds = IndexedDataset(prefix)
        sequences = [s for doc in DOCUMENTS for s in doc]
        assert len(ds) == len(sequences)
        assert ds.dtype == np.dtype(dtype)
        assert ds.document_indices.tolist() == [0, 1, 3, 4, 6, 7]
        assert ds.num_documents == len(DOCUMENTS)
        assert ds.sequence_lengths.tolist() == [len(s) for s in sequences]
        for i, s in enumerate(sequences):
            assert ds[i].dtype == np.dtype(dtype)
            np.testing.assert_array_equal(ds[i], np.asarray(s, dtype=dtype))


def test_matches_bytes_written_by_upstream_megatron(tmp_path):
    prefix = str(tmp_path / "d")
    build(prefix, [[[1, 2, 3]], [[4, 5], [6]]], np.uint16)
    with open(prefix + ".idx", "rb") as f:
        assert f.read().hex() == UPSTREAM_IDX_HEX
    with open(prefix + ".bin", "rb") as f:
        assert f.read() == np.arange(1, 7, dtype="<u2").tobytes()


def test_dtype_codes():
    for dtype, code in MEGATRON_DTYPE_CODES.items():
        assert dtype_code(dtype) == code
    with pytest.raises(ValueError, match="cannot be stored"):
        dtype_code(np.uint32)


def test_optimal_dtype():
    assert optimal_dtype(50257) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(128256) == np.int32
    assert optimal_dtype(None) == np.int32


def test_get_slices_and_indexing(tmp_path):
    prefix = str(tmp_path / "d")
    build(prefix, [[list(range(10))], [list(range(100, 105))]], np.int32)
    ds = IndexedDataset(prefix)
    assert ds.get(0, offset=3, length=4).tolist() == [3, 4, 5, 6]
    assert ds.get(0, offset=7).tolist() == [7, 8, 9]
    assert ds.get(1, length=2).tolist() == [100, 101]
    assert ds.get(1, offset=5).tolist() == []
    assert ds[-1].tolist() == list(range(100, 105))
    assert [s.tolist() for s in ds[0:2]] == [list(range(10)), list(range(100, 105))]
    assert ds.sequence_pointers.tolist() == [0, 40]
    with pytest.raises(IndexError):
        ds[2]
    with pytest.raises(IndexError):
        ds.get(0, offset=8, length=3)


def test_add_document_with_sequence_lengths(tmp_path):
    prefix = str(tmp_path / "d")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    builder.add_document([1, 2, 3, 4, 5], lengths=[2, 3])
    builder.add_document(np.array([9]))
    builder.finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert [ds[i].tolist() for i in range(3)] == [[1, 2], [3, 4, 5], [9]]
    with pytest.raises(ValueError, match="sum to"):
        IndexedDatasetBuilder(str(tmp_path / "e.bin"), np.uint16).add_document([1, 2], lengths=[1])


def test_torch_tensors_accepted(tmp_path):
    import torch
    prefix = str(tmp_path / "d")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int64)
    builder.add_item(torch.tensor([5, 6, 7]))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    assert IndexedDataset(prefix)[0].tolist() == [5, 6, 7]


def test_merge_shards_with_add_index(tmp_path):
    a, b, merged = (str(tmp_path / n) for n in ("a", "b", "merged"))
    build(a, [[[1, 2]], [[3], [4, 5]]], np.uint16)
    build(b, [[[6, 7, 8]], [[]], [[9]]], np.uint16)
    builder = IndexedDatasetBuilder(merged + ".bin", np.uint16)
    builder.add_index(a)
    builder.add_index(b)
    builder.finalize(merged + ".idx")
    ds = IndexedDataset(merged)
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [4, 5], [6, 7, 8], [], [9]]
    assert ds.document_indices.tolist() == [0, 1, 3, 4, 5, 6]
    # Same bytes as writing everything in one go.
    build(str(tmp_path / "direct"), [[[1, 2]], [[3], [4, 5]], [[6, 7, 8]], [[]], [[9]]], np.uint16)
    for suffix in (".bin", ".idx"):
        with open(merged + suffix, "rb") as x, open(str(tmp_path / "direct") + suffix, "rb") as y:
            assert x.read() == y.read()
    wrong = IndexedDatasetBuilder(str(tmp_path / "w.bin"), np.int32)
    with pytest.raises(ValueError, match="same tokenizer"):
        wrong.add_index(a)
    wrong.discard()


def test_nothing_under_final_names_until_finalize(tmp_path):
    prefix = str(tmp_path / "d")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    builder.add_item([1, 2, 3])
    builder.end_document()
    assert not os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx")
    builder.finalize(prefix + ".idx")
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]
    with pytest.raises(RuntimeError, match="already finalized"):
        builder.add_item([4])


def test_crash_leaves_no_files(tmp_path):
    prefix = str(tmp_path / "d")
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetBuilder(prefix + ".bin", np.int32) as builder:
            builder.add_item([1, 2, 3])
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_values_must_fit_dtype(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    with pytest.raises(ValueError, match="do not fit in uint16"):
        builder.add_item([1, 70000])
    with pytest.raises(ValueError, match="do not fit"):
        builder.add_item([-1])
    with pytest.raises(ValueError, match="1-D"):
        builder.add_item([[1, 2]])
    builder.discard()
    assert os.listdir(tmp_path) == []


def test_builder_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="cannot be stored"):
        IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint32)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        IndexedDatasetBuilder(str(tmp_path / "missing_dir" / "d.bin"), np.int32)
    assert os.listdir(tmp_path) == []


def test_reader_errors(tmp_path):
    prefix = str(tmp_path / "d")
    with pytest.raises(FileNotFoundError, match=r"d\.bin and .*d\.idx"):
        IndexedDataset(prefix)
    build(prefix, [[[1, 2, 3]], [[4, 5]]], np.int32)

    with open(prefix + ".idx", "rb") as f:
        good_idx = f.read()
    with open(prefix + ".idx", "wb") as f:
        f.write(b"NOTANIDX!" + good_idx[9:])
    with pytest.raises(ValueError, match="bad header"):
        IndexedDataset(prefix)
    with open(prefix + ".idx", "wb") as f:
        f.write(good_idx[:40])
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(prefix)
    with open(prefix + ".idx", "wb") as f:
        f.write(good_idx)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(12)
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(prefix)


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "d")
    IndexedDatasetBuilder(prefix + ".bin", np.uint16).finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]


def test_pickle_reopens(tmp_path):
    prefix = str(tmp_path / "d")
    build(prefix, [[[1, 2, 3]]], np.uint16)
    clone = pickle.loads(pickle.dumps(IndexedDataset(prefix)))
    assert clone[0].tolist() == [1, 2, 3]


def test_no_mmap_bin_files_reads_the_same_tokens(tmp_path):
    """--no-mmap-bin-files: file reads instead of a memory map, same sequences."""
    prefix = str(tmp_path / "ds")
    build(prefix, [[[1, 2, 3]], [[4]], [[5, 6, 7, 8]]], np.int32)
    mapped, read = IndexedDataset(prefix), IndexedDataset(prefix, mmap_bin_files=False)
    assert mapped.uses_mmap and not read.uses_mmap
    for i in range(len(mapped)):
        assert np.array_equal(mapped[i], read[i])
    assert np.array_equal(read.get(2, offset=1, length=2), [6, 7])
    assert read[0].flags.writeable and not mapped[0].flags.writeable
    assert not pickle.loads(pickle.dumps(read)).uses_mmap
