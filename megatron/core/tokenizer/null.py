"""A tokenizer for synthetic data: text is space-separated integer ids."""

from typing import List, Sequence

from megatron.core.tokenizer.base import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """``"5 7 1"`` <-> ``[5, 7, 1]``; used with ``--mock-data`` and for benchmarks.

    The EOD id is the last id, ``vocab_size - 1`` (Megatron's convention: EOD sits just
    past the "real" ids). Note the argument is the *total* size including EOD; upstream
    Megatron's ``NullTokenizer(n)`` instead reports ``vocab_size == n + 1`` with EOD ``n``.
    Both put EOD at ``vocab_size - 1``.
    """

    def __init__(self, vocab_size: int):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(
                f"NullTokenizer needs --vocab-size >= 2 (ids plus the EOD id), got {vocab_size!r}."
            )
        self._vocab_size = vocab_size

    def tokenize(self, text: str) -> List[int]:
        if not isinstance(text, str):
            raise ValueError(f"tokenize() takes a str, got {type(text).__name__}.")
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(
                "NullTokenizer input must be space-separated integers, e.g. '12 7 3'; "
                f"got {text[:60]!r}."
            ) from None
        for i in ids:
            if not 0 <= i < self._vocab_size:
                raise ValueError(
                    f"NullTokenizer id {i} is outside 0..{self._vocab_size - 1}; raise --vocab-size."
                )
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._vocab_size - 1
