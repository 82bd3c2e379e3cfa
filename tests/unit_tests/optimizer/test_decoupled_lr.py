"""--decoupled-lr / --decoupled-min-lr: the word embedding and the output layer follow their
own peak and minimum LR, on the same warmup and decay as the other parameters (upstream's
param groups with max_lr/min_lr)."""

import math

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, OptimizerParamScheduler, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig

LR, MIN_LR, DEC_LR, DEC_MIN_LR = 1e-3, 1e-4, 5e-2, 2e-2
WARMUP, DECAY = 2, 10  # in samples: one sample per step here


def build(decoupled_lr, decoupled_min_lr, optimizer="adam"):
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                               hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, 64, 8, share_embeddings_and_output_weights=False)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer=optimizer, lr=LR, min_lr=MIN_LR, weight_decay=0.0,
                                                 sgd_momentum=0.0, decoupled_lr=decoupled_lr,
                                                 decoupled_min_lr=decoupled_min_lr), model)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP,
                                    lr_decay_steps=DECAY, lr_decay_style="cosine")
    return model, opt, sched


def expected(step, max_lr, min_lr):
    if step <= WARMUP:
        return max_lr * step / WARMUP
    if step > DECAY:
        return min_lr
    ratio = (step - WARMUP) / (DECAY - WARMUP)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


def lr_of(opt, param):
    return next(g["lr"] for g in opt.param_groups if any(p is param for p in g["params"]))


def test_embedding_and_output_follow_their_own_curve():
    model, opt, sched = build(DEC_LR, DEC_MIN_LR)
    embedding, output = model.embedding.word_embeddings.weight, model.output_layer.weight
    others = [p for n, p in model.named_parameters() if p is not embedding and p is not output]
    for step in range(DECAY + 3):
        assert lr_of(opt, embedding) == pytest.approx(expected(step, DEC_LR, DEC_MIN_LR))
        assert lr_of(opt, output) == pytest.approx(expected(step, DEC_LR, DEC_MIN_LR))
        for p in others:
            assert lr_of(opt, p) == pytest.approx(expected(step, LR, MIN_LR))
        sched.step(1)
    assert opt.param_groups[0]["lr"] == pytest.approx(MIN_LR)  # the log's LR stays the main one


def test_decoupled_min_lr_defaults_to_min_lr():
    model, opt, sched = build(DEC_LR, None)
    sched.step(DECAY + 1)
    assert lr_of(opt, model.embedding.word_embeddings.weight) == pytest.approx(MIN_LR)


def test_the_step_applies_the_decoupled_lr():
    # Plain SGD: the update is -lr * grad, so each weight shows the LR it was stepped with.
    model, opt, sched = build(DEC_LR, DEC_MIN_LR, optimizer="sgd")
    sched.step(WARMUP)  # peak
    tokens = torch.randint(0, 64, (2, 8))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(tokens, torch.arange(8).expand(2, 8), None, labels=tokens).float().mean().backward()
    opt.step()
    for name, p in model.named_parameters():
        lr = DEC_LR if name in ("embedding.word_embeddings.weight", "output_layer.weight") else LR
        torch.testing.assert_close(before[name] - p.detach(), lr * p.grad, rtol=1e-4, atol=1e-7)


def test_without_decoupled_lr_one_schedule():
    model, opt, _ = build(None, None)
    assert all("max_lr" not in g for g in opt.param_groups)
    assert {g["name"] for g in opt.param_groups} == {"decay", "no_decay"}
