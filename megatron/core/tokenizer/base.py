"""The interface every tokenizer in this package implements."""

from abc import ABC, abstractmethod
from typing import Dict, List, Sequence


class MegatronTokenizer(ABC):
    """Text <-> token ids, plus the few facts the trainer and the datasets need.

    ``vocab_size`` is the tokenizer's own size; the model pads it with
    :func:`megatron.core.tokenizer.padded_vocab_size`. ``eod`` is the id appended after
    every document by ``tools/preprocess_data.py --append-eod``.
    """

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text``."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """Id of the end-of-document token."""

    @property
    def vocab(self) -> Dict[str, int]:
        """Token string -> id."""
        raise NotImplementedError(f"{type(self).__name__} has no string vocabulary")

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> token string."""
        raise NotImplementedError(f"{type(self).__name__} has no string vocabulary")
