"""Fill-in-the-middle samples (megatron/core/datasets/fim.py, upstream's GPTFIMDataset) on a
real tokenizer file: a byte-level BPE with no merges (one token per ASCII character, so a
piece re-tokenizes to exactly its original tokens and the reordering can be checked token by
token) plus upstream's FIM special tokens."""

import json

import numpy as np
import pytest

from megatron.core.datasets import GPTDataset, IndexedDataset
from megatron.core.datasets.fim import FIMConfig, FIMTransform
from megatron.core.tokenizer import GPT2BPETokenizer, HuggingFaceTokenizer, default_gpt2_vocab_files

SPECIALS = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<file_sep>"]
TEXT = ("def add(a, b):\n    return a + b\n", "class Point:\n    x = 0\n    y = 1\n",
        "print('fill in the middle')\n", "for i in range(10):\n    total += i\n")


def build_char_tokenizer(directory) -> str:
    """tokenizer.json + tokenizer_config.json of a byte-level BPE without merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # test-only package

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(list(TEXT), trainers.BpeTrainer(
        vocab_size=len(alphabet) + len(SPECIALS), special_tokens=SPECIALS, initial_alphabet=alphabet,
        show_progress=False))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return str(directory)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = HuggingFaceTokenizer(build_char_tokenizer(tmp_path_factory.mktemp("fim_tok")))
    assert len(tok.tokenize(TEXT[0])) == len(TEXT[0])  # one token per character
    return tok


@pytest.fixture(scope="module")
def ids(tokenizer):
    return {name: tokenizer.vocab[token] for name, token in
            zip(("eod", "P", "M", "S", "pad", "sep"), SPECIALS)}


def fim(tokenizer, **kw):
    return FIMTransform(tokenizer, FIMConfig(**kw))


def split_layout(out, ids, spm=False):
    """(prefix, suffix, middle) of a FIM'd document, the tokens between the sentinels
    (SPM, ``<P> <S> suffix <M> prefix middle``: prefix None, middle = prefix + middle)."""
    assert out[0] == ids["P"]
    s = int(np.flatnonzero(out == ids["S"])[0])
    m = int(np.flatnonzero(out == ids["M"])[0])
    if spm:
        assert s == 1
        return None, out[2:m], out[m + 1:]
    return out[1:s], out[s + 1:m], out[m + 1:]


def test_rate_zero_is_the_identity(tokenizer, ids):
    transform = fim(tokenizer, rate=0.0, spm_rate=0.5)
    doc = np.array(tokenizer.tokenize(TEXT[0]))
    window = np.concatenate([[ids["eod"]], doc[:10], [ids["eod"], ids["eod"]], doc[10:], [ids["eod"]]])
    for index in range(5):
        np.testing.assert_array_equal(transform(window, FIMTransform.rng(3, "train", index)), window)


@pytest.mark.parametrize("spm_rate", [0.0, 1.0])
def test_rate_one_reorders_exactly(tokenizer, ids, spm_rate):
    """Every window is FIM'd; the pieces are the original's prefix/middle/suffix in PSM or
    SPM order, with the 3 sentinels pushing the tail out (sample length kept)."""
    transform = fim(tokenizer, rate=1.0, spm_rate=spm_rate)
    window = np.array(tokenizer.tokenize(TEXT[1]), dtype=np.int64)
    n = len(window)
    seen = set()
    for index in range(20):
        out = transform(window, FIMTransform.rng(5, "train", index))
        assert out.shape == window.shape and out.dtype == np.int64
        spm = spm_rate == 1.0
        prefix, suffix, tail = split_layout(out, ids, spm)
        b = n - len(suffix)  # suffix = window[b:]
        np.testing.assert_array_equal(suffix, window[b:])
        if spm:  # tail = prefix + middle = window[:b], cut by the 3 sentinels
            np.testing.assert_array_equal(tail, window[:b][:n - 3 - len(suffix)])
        else:
            a = len(prefix)
            np.testing.assert_array_equal(prefix, window[:a])
            np.testing.assert_array_equal(tail, window[a:b][:n - 3 - a - len(suffix)])
            seen.add((a, b))
    assert spm_rate == 1.0 or len(seen) > 5  # the cut points vary with the sample index


def test_each_document_between_eods_is_transformed(tokenizer, ids):
    transform = fim(tokenizer, rate=1.0, spm_rate=0.0)
    docs = [np.array(tokenizer.tokenize(t)) for t in TEXT[:3]]
    window = np.concatenate([docs[0], [ids["eod"]], docs[1], [ids["eod"]], docs[2]])
    out = transform(window, FIMTransform.rng(0, "train", 0))
    assert out.shape == window.shape
    eods = np.flatnonzero(out == ids["eod"])
    assert list(eods) == [len(docs[0]) + 3, len(docs[0]) + len(docs[1]) + 7]  # 3 sentinels per document
    for start, doc in zip([0, eods[0] + 1], docs[:2]):
        piece = out[start:start + len(doc) + 3]
        prefix, suffix, middle = split_layout(piece, ids)
        np.testing.assert_array_equal(np.concatenate([prefix, middle, suffix]), doc)


def test_deterministic_given_the_seed(tokenizer, ids, tmp_path):
    from megatron.core.datasets import IndexedDatasetBuilder

    prefix = str(tmp_path / "code")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for text in TEXT * 4:
        builder.add_item(np.array(tokenizer.tokenize(text) + [ids["eod"]]))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    docs = np.arange(len(TEXT) * 4)

    def dataset(seed, rate=0.5):
        return GPTDataset(IndexedDataset(prefix), docs, 12, 32, seed, None, "train",
                          fim=fim(tokenizer, rate=rate, spm_rate=0.5))

    a, b, c, plain = dataset(1), dataset(1), dataset(2), dataset(1, rate=0.0)
    order = [5, 0, 11, 3]  # read in another order: a sample does not depend on what was read before
    first = {i: a[i]["tokens"] for i in range(12)}
    for i in order:
        np.testing.assert_array_equal(b[i]["tokens"], first[i])
    assert any(not np.array_equal(c[i]["tokens"], first[i]) for i in range(12))
    changed = [i for i in range(12) if not np.array_equal(first[i], plain[i]["tokens"])]
    assert 0 < len(changed) < 12  # rate 0.5: some samples FIM'd, some not
    for i in range(12):
        np.testing.assert_array_equal(a[i]["labels"][:-1], a[i]["tokens"][1:])


def test_split_sample_fragments(tokenizer, ids):
    """--fim-split-sample: each fragment between <file_sep> tokens is FIM'd on its own."""
    transform = fim(tokenizer, rate=1.0, spm_rate=0.0, split_sample="<file_sep>", fragment_rate=1.0)
    files = [np.array(tokenizer.tokenize(t)) for t in TEXT[:2]]
    window = np.concatenate([files[0], [ids["sep"]], files[1]])
    out = transform(window, FIMTransform.rng(0, "train", 1))
    seps = np.flatnonzero(out == ids["sep"])
    assert list(seps) == [len(files[0]) + 3]
    prefix, suffix, middle = split_layout(out[:seps[0]], ids)
    np.testing.assert_array_equal(np.concatenate([prefix, middle, suffix]), files[0])
    split_layout(out[seps[0] + 1:], ids)  # the second file is FIM'd too
    # fragment rate 0: the document is cut but no fragment changes
    keep = fim(tokenizer, rate=1.0, spm_rate=0.0, split_sample="<file_sep>", fragment_rate=0.0)
    np.testing.assert_array_equal(keep(window, FIMTransform.rng(0, "train", 1)), window)


def test_no_prefix_leaves_matching_documents(tokenizer, ids):
    transform = fim(tokenizer, rate=1.0, spm_rate=0.0, no_prefix="class")
    kept = np.array(tokenizer.tokenize(TEXT[1]))
    np.testing.assert_array_equal(transform(kept, FIMTransform.rng(0, "train", 0)), kept)
    other = np.array(tokenizer.tokenize(TEXT[0]))
    assert transform(other, FIMTransform.rng(0, "train", 0))[0] == ids["P"]


def test_bad_input(tokenizer):
    gpt2 = GPT2BPETokenizer(*default_gpt2_vocab_files())  # the real GPT-2 vocabulary: no FIM tokens
    with pytest.raises(ValueError, match=r"no token '<fim_prefix>' \(--fim-prefix-token\)"):
        fim(gpt2, rate=0.5, spm_rate=0.5)
    with pytest.raises(ValueError, match=r"--fim-rate must be a probability in \[0, 1\], got 1.5"):
        FIMConfig(rate=1.5)
    with pytest.raises(ValueError, match="--fim-spm-rate"):
        FIMConfig(spm_rate=-0.1)
    with pytest.raises(ValueError, match="--fim-split-sample needs --fim-fragment-rate"):
        FIMConfig(split_sample="<file_sep>")
    with pytest.raises(ValueError, match=r"no token '<nope>' \(--fim-split-sample\)"):
        fim(tokenizer, split_sample="<nope>", fragment_rate=0.5)
