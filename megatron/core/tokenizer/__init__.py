"""Tokenizers: GPT-2 byte-level BPE, HuggingFace (local), and a null tokenizer for synthetic data."""

from megatron.core.tokenizer.base import MegatronTokenizer
from megatron.core.tokenizer.factory import TOKENIZER_TYPES, build_tokenizer, padded_vocab_size
from megatron.core.tokenizer.gpt2_bpe import GPT2BPETokenizer, default_gpt2_vocab_files
from megatron.core.tokenizer.huggingface import HuggingFaceTokenizer
from megatron.core.tokenizer.null import NullTokenizer

__all__ = [
    "MegatronTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "TOKENIZER_TYPES",
    "build_tokenizer",
    "default_gpt2_vocab_files",
    "padded_vocab_size",
]
