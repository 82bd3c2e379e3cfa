"""OptimizerParamScheduler follows Megatron's semantics (steps counted in samples)."""

import math

import pytest
import torch

from megatron.core.optimizer import (
    OptimizerConfig,
    OptimizerParamScheduler,
    get_megatron_optimizer,
    get_param_groups,
)

GBS = 16


def make_scheduler(style, warmup_iters=10, decay_iters=100, max_lr=1.0, min_lr=0.1, init_lr=0.0):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=123.0)
    return opt, OptimizerParamScheduler(
        opt, init_lr=init_lr, max_lr=max_lr, min_lr=min_lr,
        lr_warmup_steps=warmup_iters * GBS, lr_decay_steps=decay_iters * GBS,
        lr_decay_style=style, weight_decay=0.1,
    )


def lr_after(sched, opt, iters):
    sched.num_steps = 0
    sched.step(iters * GBS)
    return opt.param_groups[0]["lr"]


def test_construction_applies_step_zero():
    opt, sched = make_scheduler("cosine", init_lr=0.05)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)  # Megatron: first step at init_lr


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_linear_warmup(style):
    opt, sched = make_scheduler(style)
    assert lr_after(sched, opt, 0) == 0.0
    assert lr_after(sched, opt, 5) == pytest.approx(0.5)
    assert lr_after(sched, opt, 10) == pytest.approx(1.0)


def test_constant():
    opt, sched = make_scheduler("constant")
    for it in (11, 50, 100, 1000):
        assert lr_after(sched, opt, it) == pytest.approx(1.0)


def test_linear_decay():
    opt, sched = make_scheduler("linear")
    assert lr_after(sched, opt, 55) == pytest.approx(0.1 + 0.9 * (1 - 45 / 90))
    assert lr_after(sched, opt, 100) == pytest.approx(0.1)
    assert lr_after(sched, opt, 150) == pytest.approx(0.1)


def test_cosine_decay():
    opt, sched = make_scheduler("cosine")
    for it in (10, 32, 55, 77, 100):
        ratio = (it - 10) / 90
        expected = 0.1 + 0.9 * 0.5 * (math.cos(math.pi * ratio) + 1)
        assert lr_after(sched, opt, it) == pytest.approx(expected)
    assert lr_after(sched, opt, 101) == pytest.approx(0.1)


def test_no_warmup_starts_at_max_lr():
    opt, sched = make_scheduler("cosine", warmup_iters=0)
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)


def test_incremental_steps_equal_jump():
    opt, sched = make_scheduler("cosine")
    for _ in range(37):
        sched.step(GBS)
    lr = opt.param_groups[0]["lr"]
    opt2, sched2 = make_scheduler("cosine")
    assert lr_after(sched2, opt2, 37) == pytest.approx(lr)


def test_state_dict_roundtrip():
    opt, sched = make_scheduler("linear")
    sched.step(42 * GBS)
    opt2, sched2 = make_scheduler("linear")
    sched2.load_state_dict(sched.state_dict())
    assert sched2.num_steps == 42 * GBS
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_weight_decay_respects_group_multiplier():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1.0, weight_decay=0.3), model)
    OptimizerParamScheduler(opt, 0.0, 1.0, 0.0, 0, 100, "constant", weight_decay=0.3)
    decay = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert decay == {"decay": 0.3, "no_decay": 0.0}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr_decay_style="step"), "lr_decay_style"),
        (dict(min_lr=2.0), "min_lr"),
        (dict(lr_warmup_steps=100), "warmup"),
        (dict(lr_decay_steps=0), "lr_decay_steps"),
    ],
)
def test_rejects_bad_schedules(kwargs, match):
    base = dict(init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=100, lr_decay_style="linear")
    base.update(kwargs)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=match):
        OptimizerParamScheduler(opt, **base)


def test_param_groups_exclude_biases_and_norms_from_decay():
    model = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(10, 4), "fc": torch.nn.Linear(4, 4), "norm": torch.nn.LayerNorm(4)}
    )
    groups = {g["name"]: g for g in get_param_groups(model.named_parameters())}
    decay_ids = {id(p) for p in groups["decay"]["params"]}
    no_decay_ids = {id(p) for p in groups["no_decay"]["params"]}
    assert decay_ids == {id(model["emb"].weight), id(model["fc"].weight)}
    assert no_decay_ids == {id(model["fc"].bias), id(model["norm"].weight), id(model["norm"].bias)}


def test_adam_is_adamw_and_sgd_has_momentum():
    model = torch.nn.Linear(3, 3)
    adam = get_megatron_optimizer(OptimizerConfig(lr=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6), model)
    assert isinstance(adam, torch.optim.AdamW)
    assert adam.defaults["betas"] == (0.8, 0.95) and adam.defaults["eps"] == 1e-6
    sgd = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.7), model)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.7
    with pytest.raises(ValueError, match="optimizer"):
        OptimizerConfig(optimizer="lamb")
