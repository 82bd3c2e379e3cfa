"""Upstream Megatron-LM's ``TikTokenizer``: byte-level BPE run by the ``tiktoken`` package.

The tokenizer file (``--tokenizer-model``) is upstream's JSON: a list of
``{"rank": i, "token_bytes": base64, "token_str": str}`` in rank order, ranks 0..255 being the
single bytes. Ids: the first ``num_special_tokens`` ids are the special tokens (the given
list, which must contain upstream's seven, then ``<SPECIAL_i>`` fillers); BPE rank ``r`` is id
``num_special_tokens + r``. ``vocab_size`` (default 2**17) is the total: the file is cut to its
first ``vocab_size - num_special_tokens`` ranks and must hold at least that many. EOD is ``</s>``.
Text is split by the v1 or v2 pre-tokenization pattern before BPE (upstream's, verbatim).
"""

from __future__ import annotations

import base64
import json
import os
from typing import Dict, List, Optional, Sequence

from megatron.core.tokenizer.base import MegatronTokenizer

# Upstream's pre-tokenization regexes (megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py).
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
          r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+",
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
DEFAULT_VOCAB_SIZE = 2 ** 17


def read_ranks(path: str, num_ranks: int) -> Dict[bytes, int]:
    """The first ``num_ranks`` entries of upstream's tokenizer JSON: token bytes -> rank."""
    if not path.endswith(".json") or not os.path.isfile(path):
        raise ValueError(f"--tokenizer-model {path!r}: TikTokenizer needs an existing .json tokenizer file "
                         "(a list of {rank, token_bytes, token_str}).")
    with open(path) as f:
        entries = json.load(f)
    if not isinstance(entries, list) or len(entries) < num_ranks:
        raise ValueError(f"{path}: {len(entries) if isinstance(entries, list) else 'no'} ranks for a vocabulary "
                         f"that needs {num_ranks}; lower --vocab-size (special tokens + ranks).")
    ranks = {}
    for i, entry in enumerate(entries[:num_ranks]):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} or entry["rank"] != i:
            raise ValueError(f"{path}: entry {i} is not {{rank: {i}, token_bytes, token_str}}.")
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise ValueError(f"{path}: rank {i} must be the single byte {i} (ranks 0..255 are the bytes).")
        ranks[token] = i
    if len(ranks) != num_ranks:
        raise ValueError(f"{path}: the first {num_ranks} ranks repeat a token.")
    return ranks


def write_ranks(path: str, merged_tokens: Sequence[bytes]) -> int:
    """Write upstream's tokenizer JSON: the 256 single bytes, then ``merged_tokens`` in rank
    order (each must be reachable by merging two lower-ranked tokens). Returns the rank count."""
    tokens = [bytes([i]) for i in range(256)] + list(merged_tokens)
    with open(path, "w") as f:
        json.dump([{"rank": i, "token_bytes": base64.b64encode(t).decode("ascii"),
                    "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(tokens)], f)
    return len(tokens)


class TikTokenizer(MegatronTokenizer):
    def __init__(self, path: str, pattern: Optional[str] = "v2", vocab_size: Optional[int] = None,
                 num_special_tokens: int = 1000, special_tokens: Optional[Sequence[str]] = None):
        import tiktoken  # optional dependency (the tiktoken extra): only this tokenizer needs it

        pattern = pattern or "v2"  # upstream's default
        if pattern not in PATTERNS:
            raise ValueError(f"--tiktoken-pattern must be v1 or v2, got {pattern!r}.")
        vocab_size = vocab_size or DEFAULT_VOCAB_SIZE
        special = list(special_tokens) if special_tokens else list(SPECIAL_TOKENS)
        missing = [t for t in SPECIAL_TOKENS if t not in special]
        if missing or len(set(special)) != len(special):
            raise ValueError(f"--tokenizer-special-tokens must be unique and include {' '.join(SPECIAL_TOKENS)}"
                             + (f"; missing {' '.join(missing)}." if missing else "."))
        if not len(special) <= num_special_tokens < vocab_size:
            raise ValueError(f"--tiktoken-num-special-tokens ({num_special_tokens}) must be at least the "
                             f"{len(special)} special tokens and below the vocabulary size ({vocab_size}).")
        special += [f"<SPECIAL_{i}>" for i in range(len(special), num_special_tokens)]
        self.special_tokens = special
        self.num_special_tokens = num_special_tokens
        self._vocab_size = vocab_size
        ranks = read_ranks(path, vocab_size - num_special_tokens)
        self.pattern = PATTERNS[pattern]
        self.ranks = ranks  # token bytes -> BPE rank (its id is num_special_tokens + rank)
        self.encoding = tiktoken.Encoding(
            name=os.path.basename(path), pat_str=self.pattern,
            mergeable_ranks={token: rank + num_special_tokens for token, rank in ranks.items()},
            special_tokens={token: i for i, token in enumerate(special)})
        self._eod = special.index("</s>")

    def tokenize(self, text: str) -> List[int]:
        # Special tokens in the text become their ids, as upstream's text_to_ids.
        return self.encoding.encode(text, allowed_special="all")

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int:
        return self.special_tokens.index("<s>")
