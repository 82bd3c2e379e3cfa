"""Tensors only one side has (``absent_from_checkpoint`` / ``absent_from_model``): raise
before anything changes, or load the common tensors exactly, logging the others once from
rank 0, or silently. A real DCP checkpoint of a model with a parameter 'old', loaded into
one that has 'new' instead."""

import logging

import pytest
import torch
import torch.nn as nn

from megatron.core.distributed.mfsdp_v2 import fully_shard_optimizer, load_checkpoint, save_checkpoint
from megatron.core.distributed.mfsdp_v2.checkpoint import CheckpointMismatchError, OnMismatch

from _dist_helpers import mesh_1d, rank, world, wrap
from _ckpt_helpers import adamw, full_state_zero3, remove_tmpdir, shared_tmpdir, train

RAISE, LOG, IGNORE = OnMismatch.RAISE, OnMismatch.LOG, OnMismatch.IGNORE
LOGGER = "megatron.core.distributed.mfsdp_v2.checkpoint.strictness"


class Net(nn.Module):
    """Common layers plus one parameter named ``extra`` (3 rows: uneven at 2 ranks)."""

    def __init__(self, extra: str):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
        self.extra = extra
        setattr(self, extra, nn.Parameter(torch.randn(3)))

    def forward(self, x):
        return self.inner(x).sum(-1, keepdim=True) * getattr(self, self.extra).sum()

    def units(self):
        return [self.inner, self]


def _batch(generator, rows):
    return torch.randn(rows, 5, generator=generator)


def _loss(model, x):
    return model(x).pow(2).mean()


def _wrapped(extra, seed):
    torch.manual_seed(seed)
    model = Net(extra)
    ctx = wrap(model, model.units(), mesh_1d(), "zero3")
    return model, ctx, fully_shard_optimizer(adamw(model.parameters()))


@pytest.fixture(scope="module")
def saved():
    model, ctx, optimizer = _wrapped("old", seed=0)
    train(model, ctx, optimizer, _batch, _loss, 2, seed=1, dp_rank=rank(), dp_size=world())
    truth = full_state_zero3(model, ctx, optimizer)
    path = shared_tmpdir()
    save_checkpoint(model, optimizer, path)
    yield path, truth
    remove_tmpdir(path)


def _records(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


@pytest.mark.parametrize("policies, named", [((RAISE, RAISE), ["'new'", "'old'"]), ((RAISE, IGNORE), ["'new'"]),
                                             ((IGNORE, RAISE), ["'old'"])])
def test_a_raising_policy_names_the_tensor_and_changes_nothing(saved, policies, named):
    path, _ = saved
    model, ctx, optimizer = _wrapped("new", seed=5)
    before, _ = full_state_zero3(model, ctx, optimizer)
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(model, optimizer, path, absent_from_checkpoint=policies[0], absent_from_model=policies[1])
    for name in named:
        assert name in str(info.value)
    assert ("'new'" in str(info.value)) == ("'new'" in named) and ("'old'" in str(info.value)) == ("'old'" in named)
    after, _ = full_state_zero3(model, ctx, optimizer)
    assert all(torch.equal(before[n], after[n]) for n in before) and not optimizer.state


@pytest.mark.parametrize("policies, logged", [((LOG, LOG), ["'new'", "'old'"]), ((LOG, IGNORE), ["'new'"]),
                                              ((IGNORE, IGNORE), [])])
def test_tolerated_absences_load_the_common_tensors_exactly(saved, caplog, policies, logged):
    path, (saved_params, saved_state) = saved
    model, ctx, optimizer = _wrapped("new", seed=5)
    new_before = full_state_zero3(model, ctx, optimizer)[0]["new"]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        load_checkpoint(model, optimizer, path, absent_from_checkpoint=policies[0], absent_from_model=policies[1])
    params, state = full_state_zero3(model, ctx, optimizer)
    for name in ("inner.0.weight", "inner.0.bias", "inner.2.weight", "inner.2.bias"):
        assert torch.equal(params[name], saved_params[name]), name
        assert set(state[name]) == set(saved_state[name]) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in saved_state[name].items():
            assert torch.equal(state[name][key], value), (name, key)
    # 'new' keeps its value and, with a fresh optimizer, has no state: it starts like a new parameter.
    assert torch.equal(params["new"], new_before) and state["new"] == {}
    messages = _records(caplog)
    if rank() == 0 and logged:
        assert len(messages) == 1, messages
        assert all(name in messages[0] for name in logged) and ("'old'" in messages[0]) == ("'old'" in logged)
    else:
        assert messages == []
    # Training goes on; the first step creates the state of 'new'.
    train(model, ctx, optimizer, _batch, _loss, 1, seed=2, dp_rank=rank(), dp_size=world())
    params, state = full_state_zero3(model, ctx, optimizer)
    assert set(state["new"]) == {"step", "exp_avg", "exp_avg_sq"} and float(state["new"]["step"]) == 1.0
    assert float(state["inner.0.weight"]["step"]) == 3.0


def test_a_plain_model_loads_the_common_tensors(saved):
    path, (saved_params, _) = saved
    torch.manual_seed(5)
    model = Net("new")
    new_before = model.new.detach().clone()
    load_checkpoint(model, None, path, absent_from_checkpoint=IGNORE, absent_from_model=IGNORE)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), new_before if name == "new" else saved_params[name]), name


def test_shapes_still_raise_when_absences_are_ignored(saved):
    path, _ = saved
    torch.manual_seed(5)
    model = Net("new")
    model.inner[2] = nn.Linear(7, 3)
    with pytest.raises(CheckpointMismatchError, match=r"'inner.2.weight' has shape \(2, 7\) in the checkpoint but \(3, 7\)"):
        load_checkpoint(model, None, path, absent_from_checkpoint=IGNORE, absent_from_model=IGNORE)
    with pytest.raises(TypeError, match="OnMismatch"):
        load_checkpoint(model, None, path, absent_from_model="ignore")
