"""Placements presets (the strategy table) and ``dp_axes`` given as indices or names."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from _dist_helpers import batches, local_rows, mesh_1d, mesh_2d
from _strategy_common import Net, hybrid_shapes
from megatron.core.distributed.mfsdp_v2 import (
    FsdpModule,
    Placements,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
    microbatch,
)

R, S0, P = Replicate(), Shard(0), Partial("avg")

TABLE = {
    # strategy: (parameter, gradient, optimizer)
    "no_shard": ((R,), (P,), (R,)),
    "zero1": ((R,), (P,), (S0,)),
    "zero2": ((R,), (S0,), (S0,)),
    "zero3": ((S0,), (S0,), (S0,)),
    "hsdp": ((R, S0), (P, S0), (R, S0)),
    "hfsdp": ((R, S0), (P, S0), (S0, S0)),
}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_presets_follow_the_strategy_table(name):
    preset = getattr(Placements, name)()
    parameter, gradient, optimizer = TABLE[name]
    assert (preset.parameter, preset.gradient, preset.optimizer) == (parameter, gradient, optimizer)
    assert preset.dp_axes == ((0,) if len(parameter) == 1 else (0, 1))


def test_dp_axes_accept_mesh_dim_names():
    assert Placements.hsdp("outer", "inner").dp_axes == ("outer", "inner")
    assert Placements.zero3("dp").dp_axes == ("dp",)


def _train_two_steps(placements, mesh):
    torch.manual_seed(0)
    model = Net()
    with fully_shard_context(device="cpu") as ctx:
        for unit in model.units():
            fully_shard(unit, mesh=mesh, placements=placements)
    opt = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.02))
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        opt.zero_grad()
        for i, (xb, yb) in enumerate(batches(generator, 2)):
            with microbatch(ctx, is_last=i == 1):
                F.mse_loss(model(local_rows(xb)), local_rows(yb)).backward()
        opt.step()
    records = [(r.kind, r.bytes, r.group_size) for r in ctx.counter.records]
    return [p.to_local().clone() for p in model.parameters()], records


@pytest.mark.parametrize("name", ["hsdp", "hfsdp"])
def test_named_and_indexed_axes_behave_the_same(name):
    mesh = mesh_2d(hybrid_shapes()[-1])
    by_name = _train_two_steps(getattr(Placements, name)("outer", "inner"), mesh)
    by_index = _train_two_steps(getattr(Placements, name)(0, 1), mesh)
    assert by_name[1] == by_index[1]
    assert all(torch.equal(a, b) for a, b in zip(by_name[0], by_index[0]))


def test_duplicate_axes_are_refused():
    for axes in (("outer", "outer"), (0, 0)):
        with pytest.raises(ValueError, match="twice"):
            Placements.hsdp(*axes)


def _refused(mesh, placements, match, error=ValueError):
    """fully_shard raises ``error(match)`` and leaves the module as it was."""
    model = nn.Linear(4, 4)
    weight = model.weight
    with pytest.raises(error, match=match):
        with fully_shard_context(device="cpu"):
            fully_shard(model, mesh=mesh, placements=placements)
    assert not isinstance(model, FsdpModule) and model.weight is weight and type(weight) is nn.Parameter


@pytest.mark.parametrize("name", ["hsdp", "hfsdp"])
def test_axes_in_the_wrong_order_are_refused(name):
    mesh = mesh_2d(hybrid_shapes()[-1])
    _refused(mesh, getattr(Placements, name)("inner", "outer"), "order")
    _refused(mesh, getattr(Placements, name)(1, 0), "order")


def test_axes_out_of_range_are_refused():
    mesh2 = mesh_2d(hybrid_shapes()[-1])
    _refused(mesh2, Placements.hsdp(0, 2), "out of range")
    _refused(mesh2, Placements.hsdp(-1, 1), "out of range")
    _refused(mesh2, Placements.hsdp("outer", "dp"), "not a dimension")
    _refused(mesh_1d(), Placements.zero3(1), "out of range")
    _refused(mesh_1d(), Placements.zero3("dp"), "not a dimension")


def test_hfsdp_without_zero3_on_the_inner_axis_is_refused():
    # The optimizer's outer shard refreshes sharded compute weights; with replicated
    # ones (ZeRO-2 inside) two axes would have to be gathered after every step.
    mesh = mesh_2d(hybrid_shapes()[-1])
    _refused(mesh, Placements((0, 1), (R, R), (P, S0), (S0, S0)), "needs ZeRO-3", NotImplementedError)


def test_wrong_number_of_placements_is_refused():
    with pytest.raises(ValueError, match="one placement per"):
        Placements((0, 1), (R,), (P, S0), (R, S0))
    with pytest.raises(ValueError, match="at least one"):
        Placements((), (), (), ())
