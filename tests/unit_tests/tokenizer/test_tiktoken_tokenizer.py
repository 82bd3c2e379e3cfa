"""--tokenizer-type TikTokenizer on a tokenizer file written here in upstream's format (the
256 bytes, then a few merges): the id layout (special tokens first, ranks shifted by
--tiktoken-num-special-tokens), the v1/v2 pre-tokenization, preprocess_data.py, refusals."""

import json
import os

import pytest

from megatron.core.datasets import IndexedDataset
from megatron.core.tokenizer import build_tokenizer
from megatron.core.tokenizer.tiktoken_tokenizer import write_ranks
from megatron.training.arguments import parse_args
from tools import preprocess_data

# Merges in rank order (each one two lower-ranked tokens): "the", " the", and "oW", which
# only v1's pattern can form (v2 splits "HelloWorld" into "Hello" "World").
MERGES = [b"th", b"the", b" the", b"oW", b"He", b"ll"]
SPECIAL = 16


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiktoken") / "tokenizer.json")
    return path, write_ranks(path, MERGES)


def build(path, ranks, pattern="v2"):
    return build_tokenizer("TikTokenizer", tokenizer_model=path, vocab_size=SPECIAL + ranks,
                           tiktoken_pattern=pattern, tiktoken_num_special_tokens=SPECIAL)


def test_file_format_is_upstreams(tokenizer_file):
    path, ranks = tokenizer_file
    entries = json.load(open(path))
    assert ranks == 256 + len(MERGES) and set(entries[0]) == {"rank", "token_bytes", "token_str"}
    assert entries[256 + 2] == {"rank": 258, "token_bytes": "IHRoZQ==", "token_str": " the"}


def test_ids_are_special_tokens_then_shifted_ranks(tokenizer_file):
    tok = build(*tokenizer_file)
    assert tok.vocab_size == SPECIAL + 256 + len(MERGES)
    assert (tok.eod, tok.bos) == (2, 1)  # upstream's order: <unk> <s> </s> <mask> <pad> <cls> <sep>
    rank = {m: 256 + i for i, m in enumerate(MERGES)}
    assert tok.tokenize(" the") == [SPECIAL + rank[b" the"]]
    assert tok.tokenize("a") == [SPECIAL + ord("a")]
    assert tok.tokenize("the</s>") == [SPECIAL + rank[b"the"], 2]
    assert tok.tokenize("<SPECIAL_9>") == [9]  # the fillers up to --tiktoken-num-special-tokens
    text = "Hello the world, ünïcödé 123</s>"
    assert tok.detokenize(tok.tokenize(text)) == text


def test_v1_and_v2_patterns(tokenizer_file):
    v1, v2 = build(*tokenizer_file, pattern="v1"), build(*tokenizer_file, pattern="v2")
    merged = SPECIAL + 256 + MERGES.index(b"oW")
    assert merged in v1.tokenize("HelloWorld") and merged not in v2.tokenize("HelloWorld")
    for tok in (v1, v2):
        assert tok.detokenize(tok.tokenize("HelloWorld the")) == "HelloWorld the"


def test_refusals(tokenizer_file, tmp_path):
    path, ranks = tokenizer_file
    with pytest.raises(ValueError, match="lower --vocab-size"):
        build(path, ranks + 1)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"rank": 0, "token_bytes": "AA==", "token_str": ""}, {"rank": 5}]))
    with pytest.raises(ValueError, match="entry 1"):
        build(str(bad), 2)
    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--lr 1e-3 --train-iters 10 --mock-data --tokenizer-type TikTokenizer").split()
    with pytest.raises(ValueError, match="needs --tokenizer-model FILE.json"):
        parse_args(base, world_size=1, cuda_available=False)
    with pytest.raises(ValueError, match="must include"):
        parse_args(base + ["--tokenizer-model", path, "--tokenizer-special-tokens", "<s>", "</s>"],
                   world_size=1, cuda_available=False)
    args = parse_args(base + ["--tokenizer-model", path, "--vocab-size", str(SPECIAL + ranks),
                              "--tiktoken-num-special-tokens", str(SPECIAL), "--tiktoken-pattern", "v1"],
                      world_size=1, cuda_available=False)
    assert (args.tiktoken_pattern, args.tiktoken_num_special_tokens) == ("v1", SPECIAL)


def test_preprocess_data(tokenizer_file, tmp_path):
    path, ranks = tokenizer_file
    texts = ["the cat", "HelloWorld"]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = str(tmp_path / "out" / "corpus")
    preprocess_data.preprocess(preprocess_data.get_parser().parse_args([
        "--input", str(source), "--output-prefix", prefix, "--tokenizer-type", "TikTokenizer",
        "--tokenizer-model", path, "--vocab-size", str(SPECIAL + ranks), "--tiktoken-num-special-tokens",
        str(SPECIAL), "--tiktoken-pattern", "v1", "--append-eod"]))
    tok = build(path, ranks, pattern="v1")
    ds = IndexedDataset(prefix + "_text_document")
    assert [ds[i].tolist() for i in range(2)] == [tok.tokenize(t) + [2] for t in texts]
    assert SPECIAL + 256 + MERGES.index(b"oW") in ds[1].tolist()
