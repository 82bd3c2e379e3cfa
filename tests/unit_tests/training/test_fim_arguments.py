"""--fim-* flags: upstream's names and defaults, parse-time rejection of bad values."""

import pytest

from megatron.training.arguments import parse_args
from megatron.training.training import build_tokenizer_from_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--lr 1e-3 --train-iters 10")


def parse(extra):
    return parse_args((BASE + " " + extra).split(), world_size=1, cuda_available=False)


def test_upstream_defaults():
    args = parse("--fim-data")
    assert (args.fim_rate, args.fim_spm_rate, args.fim_split_sample, args.fim_fragment_rate) == (0.5, 0.5, None, None)
    assert (args.fim_prefix_token, args.fim_middle_token, args.fim_suffix_token, args.fim_pad_token,
            args.fim_eod_token) == ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<|endoftext|>")


@pytest.mark.parametrize("extra, message", [
    ("--fim-data --fim-rate 1.5", r"--fim-rate must be a probability in \[0, 1\], got 1.5"),
    ("--fim-data --fim-spm-rate -1", r"--fim-spm-rate must be a probability"),
    ("--fim-data --fim-split-sample <sep>", "--fim-split-sample needs --fim-fragment-rate"),
    ("--fim-data --mock-data", "--mock-data has none"),
])
def test_bad_values_fail_at_parse_time(extra, message):
    with pytest.raises(ValueError, match=message):
        parse(extra)


def test_tokenizer_without_the_fim_tokens_fails_when_it_is_built():
    """Before the model: the default tokenizer (GPT-2's real vocabulary) has no <fim_prefix>;
    pretrain() turns this ValueError into its one error line (user_errors("tokenizer"))."""
    args = parse("--fim-data")
    with pytest.raises(ValueError, match=r"the tokenizer has no token '<fim_prefix>' \(--fim-prefix-token\); add it"):
        build_tokenizer_from_args(args)
    build_tokenizer_from_args(parse(""))  # without --fim-data nothing is looked up
