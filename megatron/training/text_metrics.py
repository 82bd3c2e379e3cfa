"""Bits per character: a loss that compares across tokenizers.

Nats per token depend on how much text a token holds, so a model with a 4k vocabulary
and one with GPT-2's 50k cannot be compared by their losses. Dividing the summed loss by
the characters those tokens spell (and by ln 2) can: bits per character =
nats per token x tokens / characters / ln 2.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np

from megatron.core.tokenizer import NullTokenizer


def characters_and_tokens(dataset, num_samples: int, tokenizer) -> Optional[Tuple[int, int]]:
    """(characters, tokens) of the loss-masked labels in the first ``num_samples`` samples
    of ``dataset``: the tokens an evaluation over those samples scores. The EOD token
    counts as one character (the document break). None for a tokenizer without text
    (NullTokenizer: its "text" is the ids themselves)."""
    if isinstance(tokenizer, NullTokenizer):
        return None
    eod = tokenizer.eod
    characters = tokens = 0
    for index in range(min(num_samples, len(dataset))):
        sample = dataset[index]
        labels = np.asarray(sample["labels"])[np.asarray(sample["loss_mask"]) > 0]
        is_eod = labels == eod
        tokens += int(labels.size)
        characters += len(tokenizer.detokenize(labels[~is_eod].tolist())) + int(is_eod.sum())
    return characters, tokens


def bits_per_character(loss_per_token: float, characters: int, tokens: int) -> float:
    """Nats per token -> bits per character over text of ``characters`` in ``tokens``."""
    if characters <= 0:
        raise ValueError("bits per character needs text with at least one character.")
    return loss_per_token * tokens / characters / math.log(2)
