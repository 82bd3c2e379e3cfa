"""``--check-weight-hash-across-dp-replicas-interval``: replicas with equal weights pass, a
perturbed replica is named (the majority's rank list at 4 ranks, both holders at 2), and
under MFSDP only the ranks holding the same shard are compared (ZeRO-3: none; HSDP: the
outer replicas of each inner shard).

Run at 2 and 4 ranks: ``torchrun --nproc-per-node 4 -m pytest .../test_weight_hash.py``.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _dist_helpers import mesh_2d, wrap
from megatron.core.distributed.weight_hash import (
    WeightHashMismatch,
    check_weight_hashes_across_dp_replicas,
    replicated_compute_copies,
)

W = 4


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(W, W)
        self.b = nn.Linear(W, W)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))

    def units(self):
        return [self]


def replicated_model() -> Tiny:
    torch.manual_seed(0)  # the same weights on every rank
    return Tiny()


def world_group():
    return dist.group.WORLD


def perturb(param: torch.Tensor) -> None:
    local = param.to_local() if hasattr(param, "to_local") else param
    with torch.no_grad():
        local.view(-1)[0] += 1e-3


def expected_names(world: int, bad: int) -> str:
    """What the line names: the one odd rank out against the rest, or, with two replicas
    (no majority), both."""
    if world == 2:
        return "ranks 0, 1 disagree with no majority"
    others = ", ".join(str(r) for r in range(world) if r != bad)
    return f"rank {bad} differs from ranks {others}"


def test_equal_replicas_pass():
    model = replicated_model()
    compared = check_weight_hashes_across_dp_replicas(model, world_group())
    expected = 4 if dist.get_world_size() > 1 else 0  # a.weight, a.bias, b.weight, b.bias
    assert compared == expected


@pytest.mark.skipif(not dist.is_initialized() or dist.get_world_size() < 2, reason="needs 2+ ranks")
def test_perturbed_replica_is_named():
    model = replicated_model()
    bad = dist.get_world_size() - 1
    if dist.get_rank() == bad:
        perturb(model.b.weight)
    with pytest.raises(WeightHashMismatch) as info:
        check_weight_hashes_across_dp_replicas(model, world_group())
    line = str(info.value)
    assert "\n" not in line
    assert f"{expected_names(dist.get_world_size(), bad)} in parameter b.weight" in line, line
    assert "(and" not in line  # only one parameter differs


@pytest.mark.skipif(not dist.is_initialized() or dist.get_world_size() < 2, reason="needs 2+ ranks")
def test_two_perturbed_parameters_are_counted():
    model = replicated_model()
    if dist.get_rank() == 0:
        perturb(model.a.weight)
        perturb(model.b.bias)
    with pytest.raises(WeightHashMismatch, match=r"in parameter a\.weight \(and 1 more\)"):
        check_weight_hashes_across_dp_replicas(model, world_group())


@pytest.mark.skipif(not dist.is_initialized() or dist.get_world_size() < 2, reason="needs 2+ ranks")
def test_zero3_shards_are_unique_so_nothing_is_compared():
    model = replicated_model()
    wrap(model)  # ZeRO-3 over the world: every rank holds its own shard of each parameter
    if dist.get_rank() == 0:
        perturb(model.a.weight)  # no other rank holds this shard: nothing to compare it with
    assert check_weight_hashes_across_dp_replicas(model, world_group()) == 0


@pytest.mark.skipif(not dist.is_initialized() or dist.get_world_size() < 2, reason="needs 2+ ranks")
def test_zero1_compares_the_replicated_compute_copies():
    model = replicated_model()
    ctx = wrap(model, placements="zero1")  # registered: own optimizer shards; compute copies: replicated
    assert check_weight_hashes_across_dp_replicas(model, world_group(), ctx) == 4
    bad = dist.get_world_size() - 1
    if dist.get_rank() == bad:
        perturb(replicated_compute_copies(ctx)[id(model.a.bias)])
    with pytest.raises(WeightHashMismatch) as info:
        check_weight_hashes_across_dp_replicas(model, world_group(), ctx)
    assert f"{expected_names(dist.get_world_size(), bad)} in parameter a.bias (compute copy)" in str(info.value)


@pytest.mark.skipif(not dist.is_initialized() or dist.get_world_size() != 4, reason="needs 4 ranks")
def test_hsdp_compares_each_shard_across_its_outer_replicas():
    model = replicated_model()
    mesh = mesh_2d((2, 2))
    wrap(model, mesh=mesh, placements="hsdp")
    # 4 parameters x 2 inner shards, each held by the 2 outer replicas.
    assert check_weight_hashes_across_dp_replicas(model, world_group()) == 8
    if dist.get_rank() == 3:  # outer 1, inner 1: its shard's other holder is rank 1 (outer 0)
        perturb(model.b.weight)
    with pytest.raises(WeightHashMismatch) as info:
        check_weight_hashes_across_dp_replicas(model, world_group())
    assert re.search(r"ranks 1, 3 disagree with no majority in parameter b\.weight$", str(info.value)), \
        str(info.value)
