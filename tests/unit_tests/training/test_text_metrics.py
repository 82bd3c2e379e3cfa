"""Bits per character: the characters an evaluation's tokens spell, counted per sample."""

import math

import numpy as np
import pytest

from megatron.core.tokenizer import NullTokenizer, build_tokenizer
from megatron.training.log_utils import format_validation_box
from megatron.training.text_metrics import bits_per_character, characters_and_tokens

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"


def _samples(ids, seq, mask_every=None):
    """GPTDataset-style samples over ``ids`` (labels are the next tokens)."""
    out = []
    for start in range(0, len(ids) - seq, seq):
        window = np.array(ids[start:start + seq + 1])
        mask = np.ones(seq, dtype=np.float32)
        if mask_every:
            mask[::mask_every] = 0.0
        out.append({"tokens": window[:-1], "labels": window[1:], "loss_mask": mask})
    return out


def test_characters_are_those_of_the_scored_labels():
    tok = build_tokenizer("GPT2BPETokenizer")
    ids = tok.tokenize(TEXT) + [tok.eod] + tok.tokenize(TEXT)
    seq = 8
    samples = _samples(ids, seq)
    characters, tokens = characters_and_tokens(samples, len(samples), tok)
    scored = [i for s in samples for i in s["labels"].tolist()]
    assert tokens == len(scored)
    # The EOD counts as one character; everything else spells its text.
    assert characters == len(tok.detokenize([i for i in scored if i != tok.eod])) + scored.count(tok.eod)
    # Masked labels are not scored, so their characters are not counted.
    masked = _samples(ids, seq, mask_every=2)
    c2, t2 = characters_and_tokens(masked, 2, tok)
    first_two = [i for s in masked[:2] for i, m in zip(s["labels"].tolist(), s["loss_mask"]) if m > 0]
    assert t2 == len(first_two) and c2 == len(tok.detokenize(first_two))


def test_bits_per_character_and_its_log_line():
    assert bits_per_character(2.0, 3, 12) == pytest.approx(2.0 * 12 / 3 / math.log(2))  # 12 tokens spell 3 characters
    with pytest.raises(ValueError):
        bits_per_character(1.0, 0, 0)
    assert characters_and_tokens(_samples(list(range(20)), 4), 2, NullTokenizer(32)) is None
    box = format_validation_box("iteration 5 on validation set", {"lm loss": 4.0}, bits_per_character=2.125)
    assert "| lm loss value: 4.000000E+00 | lm loss PPL: 5.459815E+01 | bits per character: 2.1250 |" in box
    assert "bits per character" not in format_validation_box("x", {"lm loss": 4.0})
