"""--use-mup / --mup-*: upstream's names, the width multiplier reaching the model config and
the optimizer from the command line, parse-time rejections and notes."""

import sys

import pytest

from megatron.training.arguments import parse_args
from megatron.training.model_builder import BuiltModel, build_optimizer

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
        "--lr 1e-3 --min-lr 1e-4 --train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 64")


def parse(extra):
    return parse_args((BASE + " " + extra).split(), world_size=1, cuda_available=False)


def test_flags_reach_the_config_and_the_optimizer():
    sys.path.insert(0, ".")
    from pretrain_gpt import core_transformer_config_from_args, model_provider

    args = parse("--use-mup --mup-base-hidden-size 16 --mup-embedding-mult 2.5 --mup-base-head-dim 4")
    assert args.mup_width_mult == 4.0
    config = core_transformer_config_from_args(args)
    assert (config.use_mup, config.mup_width_mult, config.mup_embedding_mult) == (True, 4.0, 2.5)
    assert config.softmax_scale == pytest.approx(2 / 16) and config.mup_output_mult == 0.25
    args.padded_vocab_size = 64
    model = model_provider(args)
    optimizer, _ = build_optimizer(args, BuiltModel(model=model, unwrapped=model))
    lrs = {g["name"]: (g.get("max_lr"), g["eps"]) for g in optimizer.param_groups}
    assert lrs["mup_decay"] == pytest.approx((2.5e-4, 1e-8 / 4)) and lrs["decay"] == (None, 1e-8)


def test_without_use_mup_the_flags_are_a_note(capsys):
    args = parse("--mup-base-hidden-size 16")
    assert "--mup-base-hidden-size without --use-mup: no effect" in capsys.readouterr().out
    assert args.mup_width_mult == 1.0


@pytest.mark.parametrize("extra, message", [
    ("--use-mup --mup-base-hidden-size 0", "--mup-base-hidden-size must be positive"),
    ("--use-mup --mup-base-head-dim -1", "--mup-base-head-dim must be positive"),
    ("--use-mup --multi-latent-attention", "not supported with --multi-latent-attention"),
])
def test_bad_values_fail_at_parse_time(extra, message):
    with pytest.raises(ValueError, match=message):
        parse(extra)
