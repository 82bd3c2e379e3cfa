import pytest

from megatron.core.tokenizer import (
    HuggingFaceTokenizer,
    NullTokenizer,
    build_tokenizer,
    padded_vocab_size,
)


def test_huggingface_from_local_dir(hf_gpt2_dir, gpt2_tokenizer):
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(hf_gpt2_dir))
    assert isinstance(tok, HuggingFaceTokenizer)
    text = "Hello world! It's a naïve test, 123."
    assert tok.tokenize(text) == gpt2_tokenizer.tokenize(text)
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.eod == 50256
    assert tok.vocab_size == 50257
    assert tok.vocab["Hello"] == 15496 and tok.inv_vocab[15496] == "Hello"


def test_huggingface_long_document_no_length_limit(hf_gpt2_dir):
    tok = HuggingFaceTokenizer(str(hf_gpt2_dir))
    assert len(tok.tokenize(" ".join(["word"] * 3000))) == 3000


def test_huggingface_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises((ValueError, OSError)):
        HuggingFaceTokenizer(str(empty))


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tok, NullTokenizer)
    assert tok.tokenize("5 7  1\n0") == [5, 7, 1, 0]
    assert tok.detokenize([5, 7, 1]) == "5 7 1"
    assert tok.vocab_size == 100
    assert tok.eod == 99  # EOD is the last id
    with pytest.raises(ValueError, match="space-separated integers"):
        tok.tokenize("5 seven")
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("100")
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ValueError, match="vocab-size"):
        NullTokenizer(1)
    with pytest.raises(NotImplementedError):
        tok.vocab


def test_unknown_tokenizer_type():
    with pytest.raises(ValueError, match="GPT2BPETokenizer"):
        build_tokenizer("SentencePiece")


def test_build_default_gpt2(gpt2_tokenizer):
    tok = build_tokenizer("GPT2BPETokenizer")
    assert tok.tokenize("Hello world") == [15496, 995]


@pytest.mark.parametrize(
    "size,multiple,expected",
    [(50257, 128, 50304), (128, 128, 128), (1, 128, 128), (129, 128, 256), (50257, 1, 50257), (100, 64, 128)],
)
def test_padded_vocab_size(size, multiple, expected):
    assert padded_vocab_size(size, multiple) == expected


def test_padded_vocab_size_errors():
    with pytest.raises(ValueError):
        padded_vocab_size(0)
    with pytest.raises(ValueError):
        padded_vocab_size(10, 0)
