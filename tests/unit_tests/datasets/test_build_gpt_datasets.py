import pytest

from megatron.core.datasets import BlendedDataset, GPTDataset, build_gpt_datasets, parse_split
from megatron.core.datasets.builder import parse_data_path
from megatron.core.datasets.utils import split_boundaries


def test_parse_split():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert parse_split(" 2, 1, 1 ") == pytest.approx([0.5, 0.25, 0.25])
    for bad, message in [("a,b", "only numbers"), ("1,2,3,4", "one to three"), ("-1,2", "non-negative"),
                         ("0,0,0", "sums to zero"), ("", "up to three"), ("1,,2", "one to three")]:
        with pytest.raises(ValueError, match=message):
            parse_split(bad)


def test_split_boundaries_follow_megatron_rounding():
    assert split_boundaries(parse_split("969,30,1"), 100) == [0, 97, 100, 100]
    assert split_boundaries(parse_split("969,30,1"), 1000) == [0, 969, 999, 1000]
    # Rounded parts 3+3+3 fall one short; Megatron shifts every boundary, not just the last.
    assert split_boundaries(parse_split("1,1,1"), 10) == [0, 4, 7, 10]
    assert split_boundaries(parse_split("1"), 7) == [0, 7, 7, 7]


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path("a") == (["a"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_data_path("1 a 3 b") == (["a", "b"], [1.0, 3.0])
    with pytest.raises(ValueError, match="odd number"):
        parse_data_path(["0.3", "a", "b"])
    with pytest.raises(ValueError, match="not a number"):
        parse_data_path(["a", "b"])
    with pytest.raises(ValueError, match="non-negative"):
        parse_data_path(["-1", "a", "2", "b"])
    with pytest.raises(ValueError, match="empty"):
        parse_data_path([])


def make_corpus(write_dataset, name, num_docs, base):
    return write_dataset([[base + d] * (10 + d % 5) for d in range(num_docs)], name=name)


def test_single_prefix_split(tmp_path, write_dataset):
    prefix = make_corpus(write_dataset, "c", 100, 0)
    train, valid, test = build_gpt_datasets([prefix], "90,10", [50, 10, 5], 8, 1234, str(tmp_path / "cache"))
    assert isinstance(train, GPTDataset) and isinstance(valid, GPTDataset) and test is None
    assert train.document_ids.tolist() == list(range(0, 90))
    assert valid.document_ids.tolist() == list(range(90, 100))
    assert len(train) >= 50 and len(valid) >= 10
    # Token d identifies document d: no sample mixes train and valid documents.
    assert all(ds.get_window(i).max() < 90 for ds in [train] for i in range(len(train)))
    assert all(valid.get_window(i).min() >= 90 for i in range(len(valid)))


def test_zero_samples_gives_none(write_dataset):
    prefix = make_corpus(write_dataset, "c", 20, 0)
    train, valid, test = build_gpt_datasets(prefix, "8,1,1", [10, 0, None], 4, 0, None)
    assert train is not None and valid is None and isinstance(test, GPTDataset)


def test_blend_of_two_prefixes(tmp_path, write_dataset):
    a = make_corpus(write_dataset, "a", 50, 0)
    b = make_corpus(write_dataset, "b", 50, 1000)
    train, valid, test = build_gpt_datasets(["0.25", a, "0.75", b], "80,20,0", [400, 40, 0], 8, 7,
                                            str(tmp_path / "cache"))
    assert isinstance(train, BlendedDataset) and isinstance(valid, BlendedDataset) and test is None
    assert len(train) == 400
    from_b = sum(int(train[i]["tokens"][0] >= 1000) for i in range(400))
    assert abs(from_b - 300) <= 1
    sample = train[0]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}


def test_eod_mask_loss_is_passed_through(write_dataset):
    prefix = write_dataset([[1, 2, 3, 0], [4, 5, 0], [6, 7, 8, 0]] * 5)
    train, _, _ = build_gpt_datasets([prefix], "1", [10, 0, 0], 4, 0, None, eod_mask_loss=True, eod_token=0)
    assert any((train[i]["loss_mask"] == 0).any() for i in range(len(train)))
    with pytest.raises(ValueError, match="eod_token"):
        build_gpt_datasets([prefix], "1", [10, 0, 0], 4, 0, None, eod_mask_loss=True)
    train, _, _ = build_gpt_datasets([prefix], "1", [10, 0, 0], 4, 0, None, eod_token=0, reset_position_ids=True,
                                     reset_attention_mask=True)
    assert all("document_start" in train[i] for i in range(len(train)))
    assert any(train[i]["position_ids"][-1] < 3 for i in range(len(train)))


def test_errors(tmp_path, write_dataset):
    prefix = make_corpus(write_dataset, "c", 20, 0)
    missing = str(tmp_path / "nope_text_document")
    with pytest.raises(FileNotFoundError, match=r"nope_text_document\.bin and .*nope_text_document\.idx"):
        build_gpt_datasets([missing], "1", [10, 0, 0], 4, 0, None)
    with pytest.raises(FileNotFoundError, match="Drop the extension"):
        build_gpt_datasets([prefix + ".bin"], "1", [10, 0, 0], 4, 0, None)
    with pytest.raises(FileNotFoundError, match="nope"):
        build_gpt_datasets(["1", prefix, "1", missing], "1", [10, 0, 0], 4, 0, None)
    with pytest.raises(ValueError, match="only numbers"):
        build_gpt_datasets([prefix], "x,y", [10, 0, 0], 4, 0, None)
    with pytest.raises(ValueError, match="three entries"):
        build_gpt_datasets([prefix], "1", [10, 0], 4, 0, None)
    with pytest.raises(ValueError, match="non-negative integers"):
        build_gpt_datasets([prefix], "1", [-5, 0, 0], 4, 0, None)
    with pytest.raises(ValueError, match="needs a sample count"):
        build_gpt_datasets(["1", prefix, "1", prefix], "1", [None, 0, 0], 4, 0, None)
    small = make_corpus(write_dataset, "small", 3, 500)
    with pytest.raises(ValueError, match="valid split is empty"):
        build_gpt_datasets(["1", prefix, "1", small], "95,5", [10, 5, 0], 4, 0, None)
