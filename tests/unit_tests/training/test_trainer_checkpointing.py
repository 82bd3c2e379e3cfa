"""Trainer-side checkpointing as the training loop uses it: Megatron's layout, exact resume
(plain and MFSDP models), and an MFSDP checkpoint read into a plain module (tools/generate.py)."""

import argparse
import logging
import os

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, OptimizerParamScheduler, get_megatron_optimizer
from megatron.training.checkpointing import (
    TRACKER_FILENAME,
    checkpoint_dir,
    load_checkpoint,
    load_common,
    read_tracker,
    save_checkpoint,
)


def make(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.01), model)
    sched = OptimizerParamScheduler(opt, 0.0, 0.01, 0.001, 4, 40, "cosine", weight_decay=0.01)
    return model, opt, sched


def train_steps(model, opt, sched, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(3, 4, generator=g)).pow(2).sum().backward()
        opt.step()
        sched.step(2)


def test_save_then_load_resumes_exactly(tmp_path, world_of_one):
    args = argparse.Namespace(save=str(tmp_path), load=str(tmp_path), lr=0.01)
    model, opt, sched = make(0)
    train_steps(model, opt, sched, 3)
    path = save_checkpoint(3, model, opt, sched, args, consumed_train_samples=6)

    assert path == checkpoint_dir(str(tmp_path), 3) == os.path.join(str(tmp_path), "iter_0000003")
    assert open(tmp_path / TRACKER_FILENAME).read() == "3"
    assert read_tracker(str(tmp_path)) == 3
    _, common = load_common(str(tmp_path))
    assert common["iteration"] == 3 and common["consumed_train_samples"] == 6

    # Reference: keep training the original.
    train_steps(model, opt, sched, 2, seed=1)
    # Resume: a differently initialized copy loads the checkpoint and trains the same steps.
    model2, opt2, sched2 = make(99)
    iteration, consumed = load_checkpoint(model2, opt2, sched2, args)
    assert (iteration, consumed) == (3, 6)
    assert sched2.num_steps == 6
    train_steps(model2, opt2, sched2, 2, seed=1)
    for a, b in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_load_without_tracker_starts_from_scratch(tmp_path, world_of_one):
    model, opt, sched = make(0)
    assert load_checkpoint(model, opt, sched, argparse.Namespace(load=str(tmp_path))) == (0, 0)
    assert load_checkpoint(model, opt, sched, argparse.Namespace(load=None)) == (0, 0)


def test_bad_tracker_and_incomplete_checkpoint_are_reported(tmp_path):
    (tmp_path / TRACKER_FILENAME).write_text("release")
    with pytest.raises(RuntimeError, match="not an iteration number"):
        read_tracker(str(tmp_path))
    (tmp_path / TRACKER_FILENAME).write_text("7")
    with pytest.raises(RuntimeError, match="incomplete"):
        load_common(str(tmp_path))


def test_model_only_load(tmp_path, world_of_one):
    args = argparse.Namespace(save=str(tmp_path), load=str(tmp_path))
    model, opt, sched = make(0)
    train_steps(model, opt, sched, 2)
    save_checkpoint(2, model, opt, sched, args)
    model2, _, _ = make(5)
    assert load_checkpoint(model2, None, None, args)[0] == 2
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


# --- MFSDP models: the engine writes model + optimizer, the trainer the rest ---------------

MFSDP_ARGV = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 8 --micro-batch-size 2 "
              "--lr 1e-2 --train-iters 20 --mock-data --tokenizer-type NullTokenizer --vocab-size 64 "
              "--hidden-dropout 0 --attention-dropout 0 --use-mfsdp").split()


def _mfsdp_model(save_dir, extra=()):
    import sys

    from megatron.training.arguments import parse_args
    from megatron.training.model_builder import build_model, build_optimizer

    sys.path.insert(0, ".")
    from pretrain_gpt import model_provider

    args = parse_args(MFSDP_ARGV + ["--save", str(save_dir), "--load", str(save_dir)] + list(extra),
                      world_size=1, cuda_available=False)
    args.padded_vocab_size = 64
    built = build_model(model_provider, args, torch.device("cpu"))
    optimizer, scheduler = build_optimizer(args, built)
    return args, built, optimizer, scheduler, model_provider


def _mfsdp_steps(built, optimizer, scheduler, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        optimizer.zero_grad()
        tokens = torch.randint(0, 64, (2, 9), generator=g)
        built.model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        optimizer.step()
        scheduler.step(2)


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


@pytest.mark.parametrize("adam", ["foreach", "fused"])
def test_mfsdp_save_load_resumes_exactly_and_loads_into_a_plain_model(tmp_path, world_of_one, adam):
    torch.manual_seed(0)
    flags = ["--optimizer-implementation", adam]
    args, built, opt, sched, provider = _mfsdp_model(tmp_path, flags)
    assert all(bool(g.get("fused")) == (adam == "fused") for g in opt.param_groups)
    _mfsdp_steps(built, opt, sched, 2, seed=0)
    save_checkpoint(2, built.model, opt, sched, args, consumed_train_samples=4)
    at_save = {name: _full(p).detach().clone() for name, p in built.model.named_parameters()}
    _, common = load_common(str(tmp_path))
    assert common["use_mfsdp"] is True and common["iteration"] == 2
    _mfsdp_steps(built, opt, sched, 2, seed=1)

    torch.manual_seed(123)  # a different initialization, overwritten by the load
    _, built2, opt2, sched2, _ = _mfsdp_model(tmp_path, flags)
    assert load_checkpoint(built2.model, opt2, sched2, args) == (2, 4)
    _mfsdp_steps(built2, opt2, sched2, 2, seed=1)
    for (name, a), (_, b) in zip(built.model.named_parameters(), built2.model.named_parameters()):
        torch.testing.assert_close(_full(a), _full(b), rtol=0, atol=0, msg=name)

    # tools/generate.py's path: the iteration-2 weights into a plain module, no optimizer.
    plain = provider(args)
    assert load_checkpoint(plain, None, None, args, load_optim=False, load_rng=False)[0] == 2
    plain_params = dict(plain.named_parameters())
    assert set(plain_params) == set(at_save)
    for name, value in at_save.items():
        torch.testing.assert_close(plain_params[name], value, rtol=0, atol=0, msg=name)


# --- --dist-ckpt-strictness: upstream's names for tensors only one side has ------------------


def _variant(seed):
    """make()'s model without the LayerNorm bias ('missing': in the checkpoint only) and
    with a parameter 'gate' ('unexpected': in the model only)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8, bias=False), torch.nn.Linear(8, 2))
    model.register_parameter("gate", torch.nn.Parameter(torch.ones(2)))
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.01), model)
    sched = OptimizerParamScheduler(opt, 0.0, 0.01, 0.001, 4, 40, "cosine", weight_decay=0.01)
    return model, opt, sched


@pytest.mark.parametrize("strictness, outcome", [
    (None, "raise"), ("raise_all", "raise"), ("raise_unexpected", "raise"), ("assume_ok_unexpected", "raise"),
    ("log_all", ["'gate'", "'1.bias'"]), ("return_all", ["'gate'", "'1.bias'"]), ("log_unexpected", ["'gate'"]),
    ("ignore_all", []),
])
def test_dist_ckpt_strictness(tmp_path, world_of_one, caplog, strictness, outcome):

    args = argparse.Namespace(save=str(tmp_path), load=str(tmp_path), dist_ckpt_strictness=strictness)
    model, opt, sched = make(0)
    train_steps(model, opt, sched, 2)
    save_checkpoint(2, model, opt, sched, args)
    model2, opt2, sched2 = _variant(7)
    before = {n: p.detach().clone() for n, p in model2.named_parameters()}
    with caplog.at_level(logging.WARNING):
        if outcome == "raise":
            with pytest.raises(RuntimeError, match="does not fit this model: .*'gate'"):
                load_checkpoint(model2, opt2, sched2, args)
            assert all(torch.equal(p, before[n]) for n, p in model2.named_parameters()) and not opt2.state
            return
        assert load_checkpoint(model2, opt2, sched2, args)[0] == 2
    saved = dict(model.named_parameters())
    for name, p in model2.named_parameters():
        assert torch.equal(p, before[name] if name == "gate" else saved[name]), name
    messages = [r.getMessage() for r in caplog.records if "lacks" in r.getMessage()]
    assert len(messages) == (1 if outcome else 0), messages
    for name in ("'gate'", "'1.bias'") if outcome else ():
        assert (name in messages[0]) == (name in outcome), (name, messages)
    train_steps(model2, opt2, sched2, 1)  # the loaded optimizer steps on
