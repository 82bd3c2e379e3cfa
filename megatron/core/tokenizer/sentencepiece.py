"""``GPTSentencePieceTokenizer``: a SentencePiece ``.model`` file (Megatron-LM's name for it).

Ids are the model's own; EOD is its end-of-sentence id (``</s>``), which is what upstream
appends after each document. The ``sentencepiece`` package is imported only when this
tokenizer is built.
"""

from typing import Dict, List, Sequence

from megatron.core.extras import MissingExtra
from megatron.core.tokenizer.base import MegatronTokenizer


class GPTSentencePieceTokenizer(MegatronTokenizer):
    def __init__(self, model_file: str):
        try:
            import sentencepiece  # imported here: the optional 'hf' extra
        except ImportError:
            raise MissingExtra("sentencepiece", "GPTSentencePieceTokenizer") from None
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        if self._sp.eos_id() < 0:
            raise ValueError(f"the SentencePiece model {model_file!r} has no end-of-sentence piece to use as EOD; "
                             "train it with eos_id set (the default).")

    def tokenize(self, text: str) -> List[int]:
        return list(self._sp.encode(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eod(self) -> int:
        return int(self._sp.eos_id())

    @property
    def vocab(self) -> Dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {i: self._sp.id_to_piece(i) for i in range(self.vocab_size)}
