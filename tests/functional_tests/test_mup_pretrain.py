"""pretrain_gpt.py --use-mup: a tiny muP model (width multiplier 2) trains, and MFSDP ZeRO-3 at
2 ranks gives the losses and grad norms of one plain rank."""

import math

import pytest

from test_pretrain_gpt import run_layouts

ARGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
        "--global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --train-iters 3 --log-interval 1 "
        "--eval-iters 0 --hidden-dropout 0 --attention-dropout 0 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 128 --num-workers 0 --seed 5 --use-mup --mup-base-hidden-size 16 "
        "--mup-embedding-mult 2.0").split()


def test_mup_mfsdp_two_ranks_equal_one_rank(tmp_path_factory):
    runs = run_layouts(ARGS, {"one": (1, []), "mfsdp": (2, ["--use-mfsdp"])}, tmp_path_factory)
    one, mfsdp = runs["one"][0], runs["mfsdp"][0]
    assert sorted(one) == sorted(mfsdp) == [1, 2, 3]
    for it in one:
        assert math.isfinite(one[it]["lm_loss"])
        assert mfsdp[it]["lm_loss"] == pytest.approx(one[it]["lm_loss"], rel=1e-5), it
        assert mfsdp[it]["grad_norm"] == pytest.approx(one[it]["grad_norm"], rel=1e-4), it
    assert one[3]["lm_loss"] < one[1]["lm_loss"]
