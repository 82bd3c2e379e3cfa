"""Fill-in-the-middle (FIM) samples: upstream Megatron-LM's ``GPTFIMDataset`` transform
(megatron/training/datasets/fim_dataset.py there), applied to a GPT sample's window.

A window of ``seq_length + 1`` tokens is cut at its EOD tokens into documents. Each
document, with probability ``rate``, is detokenized, cut at two random character positions
into prefix / middle / suffix, each piece tokenized again, and laid out with the sentinel
tokens in one of two orders (the FIM paper's):

* PSM: ``<fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle``
* SPM (probability ``spm_rate``): ``<fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle``

With ``split_sample`` (a token, e.g. a file separator inside a repository), a document
that contains it is, with probability ``rate``, cut at that token and each fragment is
transformed with probability ``fragment_rate``. A piece whose text starts with
``no_prefix`` is left alone. The result is cut or padded (``<fim_pad>``) back to the
window's length, so the sample length never changes.

Two deliberate differences from upstream, both so that a sample depends only on its seed:

* the random draws come from a generator seeded by (seed, split, sample index) instead of
  one stream per dataset object, so a sample is the same whichever rank, worker or resumed
  run reads it (upstream's outcome depends on the order samples were read);
* an empty document (two EODs in a row) or an empty fragment keeps its EOD / split token
  (upstream drops it), so ``rate`` 0 gives the window back unchanged.

The RNG calls are upstream's (a Bernoulli draw for FIM, two boundaries, a Bernoulli draw
for SPM, in that order).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

# Upstream's --fim-*-token defaults.
DEFAULT_FIM_TOKENS = {
    "prefix": "<fim_prefix>",
    "middle": "<fim_middle>",
    "suffix": "<fim_suffix>",
    "pad": "<fim_pad>",
    "eod": "<|endoftext|>",
}


@dataclass(frozen=True)
class FIMConfig:
    """The ``--fim-*`` flags. ``tokens`` maps prefix/middle/suffix/pad/eod to token strings."""

    rate: float = 0.5
    spm_rate: float = 0.5
    tokens: Optional[Dict[str, str]] = None
    split_sample: Optional[str] = None
    fragment_rate: Optional[float] = None
    no_prefix: Optional[str] = None

    def __post_init__(self):
        for name in ("rate", "spm_rate", "fragment_rate"):
            value = getattr(self, name)
            if value is None and name == "fragment_rate":
                continue
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                flag = "--fim-" + name.replace("_", "-")
                raise ValueError(f"{flag} must be a probability in [0, 1], got {value!r}.")
        if self.split_sample is not None and self.fragment_rate is None:
            raise ValueError("--fim-split-sample needs --fim-fragment-rate (the FIM rate of each fragment).")


def _token_id(tokenizer, token: str, flag: str) -> int:
    try:
        vocab = tokenizer.vocab
    except NotImplementedError:
        raise ValueError(f"--fim-data needs a tokenizer with a string vocabulary to find {token!r}; "
                         f"{type(tokenizer).__name__} has none (use a HuggingFace or GPT-2 BPE tokenizer).") from None
    if token not in vocab:
        raise ValueError(f"the tokenizer has no token {token!r} ({flag}); add it to the tokenizer as a special "
                         f"token or name the tokenizer's own token with {flag}.")
    return int(vocab[token])


class FIMTransform:
    """The FIM transform of one tokenizer and config; ``fim(window, rng)`` -> new window."""

    def __init__(self, tokenizer, config: FIMConfig):
        self.tokenizer = tokenizer
        self.config = config
        tokens = dict(DEFAULT_FIM_TOKENS, **(config.tokens or {}))
        ids = {name: _token_id(tokenizer, tokens[name], f"--fim-{name}-token") for name in DEFAULT_FIM_TOKENS}
        self.prefix_id, self.middle_id, self.suffix_id = ids["prefix"], ids["middle"], ids["suffix"]
        self.pad_id, self.eod_id = ids["pad"], ids["eod"]
        self.split_id = (None if config.split_sample is None
                         else _token_id(tokenizer, config.split_sample, "--fim-split-sample"))
        # Removed before detokenizing (upstream's remove_special_tokens=True), so that a
        # sentinel never becomes text that is then tokenized as something else.
        self._sentinels = np.array(sorted(set(ids.values())), dtype=np.int64)

    @staticmethod
    def rng(seed: int, split_name: str, index: int) -> np.random.RandomState:
        """The generator of sample ``index`` of split ``split_name``."""
        return np.random.RandomState([int(seed), zlib.crc32(split_name.encode()), int(index)])

    def __call__(self, window: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        length = window.shape[0]
        pieces = self._over_separators(window, self.eod_id, rng, self._split_and_permute)
        out = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)
        if out.shape[0] >= length:
            return out[:length]
        return np.concatenate([out, np.full(length - out.shape[0], self.pad_id, dtype=np.int64)])

    @staticmethod
    def _over_separators(sequence, separator, rng, transform) -> List[np.ndarray]:
        """``transform`` each non-empty run between ``separator`` tokens, keeping the separators;
        the run after the last separator is transformed even when empty (as upstream)."""
        pieces, start = [], 0
        for loc in np.flatnonzero(sequence == separator):
            if loc > start:
                pieces.append(transform(sequence[start:loc], rng))
            pieces.append(np.array([separator], dtype=np.int64))
            start = loc + 1
        pieces.append(transform(sequence[start:], rng))
        return pieces

    def _split_and_permute(self, document: np.ndarray, rng) -> np.ndarray:
        config = self.config
        if self.split_id is None or not np.any(document == self.split_id):
            return self._permute(document, config.rate, rng)
        if not rng.binomial(1, config.rate):
            return document
        pieces = self._over_separators(document, self.split_id, rng,
                                       lambda fragment, r: self._permute(fragment, config.fragment_rate, r))
        return np.concatenate(pieces)

    def _permute(self, sample: np.ndarray, rate: float, rng) -> np.ndarray:
        if not rng.binomial(1, rate):
            return sample
        text = self.tokenizer.detokenize(sample[~np.isin(sample, self._sentinels)].tolist())
        if self.config.no_prefix is not None and text.startswith(self.config.no_prefix):
            return sample
        lo, hi = sorted(rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (np.asarray(self.tokenizer.tokenize(part), dtype=np.int64)
                                  for part in (text[:lo], text[lo:hi], text[hi:]))
        if rng.binomial(1, self.config.spm_rate):
            parts = [[self.prefix_id, self.suffix_id], suffix, [self.middle_id], prefix, middle]
        else:
            parts = [[self.prefix_id], prefix, [self.suffix_id], suffix, [self.middle_id], middle]
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
