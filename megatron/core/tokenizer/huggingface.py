"""A HuggingFace tokenizer loaded from a local directory (never from the hub).

A directory with a ``tokenizer.json`` (every "fast" tokenizer, and what
``tools/prepare_shakespeare.py --vocab-size`` trains) is read with the small ``tokenizers``
package alone: the file holds the whole pipeline (normalizer, pre-tokenizer, model,
post-processor, decoder), which is what ``transformers.AutoTokenizer`` runs for it too.
Only a directory without one (a "slow" tokenizer such as a bare SentencePiece model) needs
``transformers``.
"""

import json
import os
from typing import Dict, List, Optional, Sequence

from megatron.core.extras import MissingExtra
from megatron.core.tokenizer.base import MegatronTokenizer

TOKENIZER_FILE = "tokenizer.json"


def _special_token(path: str, name: str) -> Optional[str]:
    """``name`` (e.g. "eos_token") from tokenizer_config.json or special_tokens_map.json."""
    for filename in ("tokenizer_config.json", "special_tokens_map.json"):
        file = os.path.join(path, filename)
        if not os.path.isfile(file):
            continue
        with open(file, encoding="utf-8") as f:
            value = json.load(f).get(name)
        if isinstance(value, dict):  # {"content": "</s>", "lstrip": false, ...}
            value = value.get("content")
        if value:
            return str(value)
    return None


class HuggingFaceTokenizer(MegatronTokenizer):
    """A saved HuggingFace tokenizer in directory ``path``.

    ``tokenize`` applies the tokenizer's own special-token template (so a tokenizer that
    adds BOS keeps doing so, as in Megatron); ``eod`` is the EOS token.
    """
    def __init__(self, path: str):
        if not path or not os.path.isdir(path):
            raise FileNotFoundError(
                f"--tokenizer-model {path!r} is not a directory; pass a local directory "
                "holding a saved HuggingFace tokenizer (tokenizer.json / tokenizer_config.json)."
            )
        self._path = path
        self._inv_vocab = None
        if os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
            self._fast = self._load_tokenizer_json(path)
            self._auto = None
        else:
            self._fast = None
            self._auto = self._load_auto_tokenizer(path)

    @staticmethod
    def _load_tokenizer_json(path: str):
        try:
            from tokenizers import Tokenizer  # import cost: the tokenizers package loads only for a tokenizer directory
        except ImportError:
            raise ImportError(
                "HuggingFaceTokenizer needs the 'tokenizers' package: run `pip install tokenizers`."
            ) from None
        file = os.path.join(path, TOKENIZER_FILE)
        try:
            tokenizer = Tokenizer.from_file(file)
        except Exception as e:  # the Rust library raises its own exception type
            raise ValueError(f"--tokenizer-model {file} is not a valid tokenizer.json ({e}).") from None
        # Documents are tokenized whole: no truncation, no padding.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        return tokenizer

    @staticmethod
    def _load_auto_tokenizer(path: str):
        try:
            # Optional dependency (MEGATRON_EXTRAS=hf), for a directory without tokenizer.json.
            from transformers import AutoTokenizer
        except ImportError:
            raise MissingExtra("transformers",
                               f"--tokenizer-model {path} (a tokenizer without tokenizer.json)") from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"--tokenizer-model {path} does not hold a loadable HuggingFace tokenizer ({e}). "
                "Save one there with tokenizer.save_pretrained(path)."
            ) from None
        # The model's max length is irrelevant here and would only produce a "sequence is
        # longer than" warning per long document.
        tokenizer.model_max_length = int(1e30)
        return tokenizer

    def tokenize(self, text: str) -> List[int]:
        if not isinstance(text, str):
            raise ValueError(f"tokenize() takes a str, got {type(text).__name__}.")
        if self._fast is not None:
            return list(self._fast.encode(text).ids)
        return list(self._auto(text)["input_ids"])

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=False)
        return self._auto.decode(ids)

    @property
    def vocab_size(self) -> int:
        # Added special tokens count too: the embedding must cover them.
        if self._fast is not None:
            return self._fast.get_vocab_size(with_added_tokens=True)
        return len(self._auto)

    @property
    def vocab(self) -> Dict[str, int]:
        if self._fast is not None:
            return self._fast.get_vocab(with_added_tokens=True)
        return self._auto.get_vocab()

    @property
    def inv_vocab(self) -> Dict[int, str]:
        if self._inv_vocab is None:
            self._inv_vocab = {v: k for k, v in self.vocab.items()}
        return self._inv_vocab

    @property
    def eod(self) -> int:
        if self._fast is not None:
            eos = _special_token(self._path, "eos_token")
            eos_id = self._fast.token_to_id(eos) if eos is not None else None
        else:
            eos_id = self._auto.eos_token_id
        if eos_id is None:
            raise ValueError(
                f"The HuggingFace tokenizer at {self._path} has no EOS token, so it has no EOD id; "
                "set eos_token in its tokenizer_config.json."
            )
        return int(eos_id)
