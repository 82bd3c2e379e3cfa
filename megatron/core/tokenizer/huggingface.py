"""A HuggingFace tokenizer loaded from a local directory (never from the hub)."""

import os
from typing import Dict, List, Sequence

from megatron.core.tokenizer.base import MegatronTokenizer


class HuggingFaceTokenizer(MegatronTokenizer):
    """Wraps ``transformers.AutoTokenizer`` loaded from ``path`` with ``local_files_only``.

    ``tokenize`` uses the tokenizer's defaults (so a tokenizer that adds BOS keeps doing so,
    as in Megatron); ``eod`` is the EOS token.
    """

    def __init__(self, path: str):
        if not path or not os.path.isdir(path):
            raise FileNotFoundError(
                f"--tokenizer-model {path!r} is not a directory; pass a local directory "
                "holding a saved HuggingFace tokenizer (tokenizer.json / tokenizer_config.json)."
            )
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError(
                "HuggingFaceTokenizer needs the 'transformers' package: run `pip install transformers`."
            ) from None
        self._path = path
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"--tokenizer-model {path} does not hold a loadable HuggingFace tokenizer ({e}). "
                "Save one there with tokenizer.save_pretrained(path)."
            ) from None
        # Documents are tokenized whole; the model's max length is irrelevant here and would
        # only produce a "sequence is longer than" warning per long document.
        self._tokenizer.model_max_length = int(1e30)
        self._inv_vocab = None

    def tokenize(self, text: str) -> List[int]:
        if not isinstance(text, str):
            raise ValueError(f"tokenize() takes a str, got {type(text).__name__}.")
        return list(self._tokenizer(text)["input_ids"])

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        # len() counts added special tokens too, which the embedding must cover.
        return len(self._tokenizer)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._tokenizer.get_vocab()

    @property
    def inv_vocab(self) -> Dict[int, str]:
        if self._inv_vocab is None:
            self._inv_vocab = {v: k for k, v in self.vocab.items()}
        return self._inv_vocab

    @property
    def eod(self) -> int:
        eos = self._tokenizer.eos_token_id
        if eos is None:
            raise ValueError(
                f"The HuggingFace tokenizer at {self._path} has no EOS token, so it has no EOD id; "
                "set eos_token in its tokenizer_config.json."
            )
        return int(eos)
