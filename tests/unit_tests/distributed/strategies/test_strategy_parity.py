"""Every strategy against a single-process reference (same init, global batch).

Covers: loss/weight/gradient parity for SGD and AdamW, 1 and 3 microbatches,
``zero_grad(set_to_none=True/False)``; several backwards without ``microbatch(...)``
accumulating; ``grad_divisor``; one unit called twice in a forward; a unit holding a 0-d
parameter and tensors of co-prime row sizes.
"""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _dist_helpers import (
    ROWS_PER_RANK,
    batches,
    build_pair,
    check,
    compare_params,
    global_mean,
    local_rows,
    make_optimizer,
    train_pair,
    wrap,
)
from _strategy_common import Net, case_id, sharding, sizes, strategy_cases
from megatron.core.distributed.mfsdp_v2 import fully_shard_optimizer, microbatch

CASES = strategy_cases()
STEPS = 3


# SGD/AdamW x 1/3 microbatches x set_to_none True/False as a covering array: every value
# of every factor, and every pair of values of any two factors, appears for every strategy.
TRAINING_CONFIGS = [("sgd", 1, True), ("sgd", 3, False), ("adamw", 1, False), ("adamw", 3, True)]


@pytest.mark.parametrize(
    "optimizer,microbatches,set_to_none",
    TRAINING_CONFIGS,
    ids=[f"{o}-mb{m}-{'none' if z else 'zero'}" for o, m, z in TRAINING_CONFIGS],
)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case, optimizer, microbatches, set_to_none):
    model, reference, ctx, _, losses, ref_losses = train_pair(
        Net, optimizer, microbatches, STEPS, set_to_none=set_to_none, **sharding(case)
    )
    # The run must train (a frozen model would make the comparison vacuous).
    assert (ref_losses[0] - ref_losses[-1]).abs() > 1e-3
    torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=2e-5)
    compare_params(model, reference)
    # The compute weights (refreshed after the step) produce the reference's output.
    x = torch.randn(ROWS_PER_RANK, 8, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_backwards_without_microbatch_accumulate(case):
    """Two plain backwards per step (no ``microbatch``): every strategy, including ZeRO-1
    and HFSDP whose once-per-step reductions run at each of them, must end with the sum of
    both backwards' gradients (averaged over ranks)."""
    model, reference, ctx = build_pair(Net, **sharding(case))
    opt = fully_shard_optimizer(make_optimizer("sgd", model.parameters()))
    ref_opt = make_optimizer("sgd", reference.parameters())
    generator = torch.Generator().manual_seed(3)
    for step in range(2):
        mbs = batches(generator, 2)
        opt.zero_grad(set_to_none=step == 0)
        ref_opt.zero_grad(set_to_none=step == 0)
        for xb, yb in mbs:
            F.mse_loss(reference(xb), yb).backward()
            F.mse_loss(model(local_rows(xb)), local_rows(yb)).backward()
        compare_params(model, reference)
        opt.step()
        ref_opt.step()
    compare_params(model, reference, grads=False)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_grad_divisor_divides_gradients(case):
    """grad_divisor=4 divides every gradient by 4 (on top of the average over ranks),
    with microbatches (step 1) and with two plain backwards (step 2). The reference runs
    plain SGD with lr/4, which makes the same updates from the undivided gradients."""
    divisor = 4.0
    model, reference, ctx = build_pair(Net, **sharding(case), grad_divisor=divisor)
    opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.2))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2 / divisor)
    generator = torch.Generator().manual_seed(5)
    for step in range(2):
        mbs = batches(generator, 2)
        opt.zero_grad()
        ref_opt.zero_grad()
        for i, (xb, yb) in enumerate(mbs):
            F.mse_loss(reference(xb), yb).backward()
            if step == 0:
                with microbatch(ctx, is_last=i == 1):
                    F.mse_loss(model(local_rows(xb)), local_rows(yb)).backward()
            else:
                F.mse_loss(model(local_rows(xb)), local_rows(yb)).backward()
        compare_params(model, reference, ref_grad_scale=1 / divisor)
        opt.step()
        ref_opt.step()
        compare_params(model, reference, grads=False)


class SharedUse(Net):
    """``blocks[0]`` (a unit) is called twice in every forward."""

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        x = self.blocks[0](x)
        return self.head(x)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_unit_called_twice_in_forward(case):
    model, reference, ctx, _, losses, ref_losses = train_pair(SharedUse, "adamw", 2, 2, **sharding(case))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=2e-5)
    compare_params(model, reference)


class OddShapes(nn.Module):
    """One unit, one group: a 0-d scale and tensors whose row sizes (3, 7, 5, 1) are co-prime."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.a = nn.Parameter(torch.randn(7, 3) * 0.4)
        self.b = nn.Parameter(torch.randn(5, 7) * 0.4)
        self.c = nn.Parameter(torch.randn(3, 5) * 0.4)
        self.bias = nn.Parameter(torch.randn(3) * 0.1)

    def forward(self, x):
        h = torch.tanh(x @ self.a.t())
        h = torch.tanh(h @ self.b.t())
        return self.scale * (h @ self.c.t()) + self.bias

    def units(self):
        return [self]


ODD_SHAPES = [(), (7, 3), (5, 7), (3, 5), (3,)]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_zero_dim_and_coprime_rows(case):
    """A 0-d parameter and co-prime row sizes in one group: whole rows per rank, padding
    per rank below one row of the widest tensor, and training equal to the reference."""
    torch.manual_seed(0)
    model = OddShapes()
    reference = copy.deepcopy(model)
    ctx = wrap(model, **sharding(case))
    (group,) = model.parameter_groups
    _, inner = sizes(case)
    total = sum(math.prod(s) for s in ODD_SHAPES)  # 21 + 35 + 15 + 3 + 1
    widest_row = 7
    name = case[0]
    shards = 1 if name == "no_shard" else inner
    assert group.layout.num_shards == shards
    even = math.ceil(total / shards)
    assert even <= group.layout.shard_numel < even + widest_row
    assert group.layout.gathered_numel == shards * group.layout.shard_numel
    # Each rank holds whole rows of every tensor (local shape = rows x full row shape).
    for pname, p in model.named_parameters():
        local = p.to_local()
        whole_rows = tuple(local.shape[1:]) == tuple(p.shape[1:]) if p.dim() > 0 else local.numel() in (0, 1)
        check(whole_rows, f"{pname}: local shape {tuple(local.shape)} of {tuple(p.shape)}")

    opt = fully_shard_optimizer(make_optimizer("adamw", model.parameters()))
    ref_opt = make_optimizer("adamw", reference.parameters())
    generator = torch.Generator().manual_seed(11)
    for _ in range(2):
        mbs = batches(generator, 2, in_features=3, out_features=3)
        opt.zero_grad()
        ref_opt.zero_grad()
        x = torch.cat([b[0] for b in mbs])
        y = torch.cat([b[1] for b in mbs])
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        total_loss = torch.zeros(())
        for i, (xb, yb) in enumerate(mbs):
            with microbatch(ctx, is_last=i == 1):
                loss = F.mse_loss(model(local_rows(xb)), local_rows(yb)) / 2
                loss.backward()
            total_loss += loss.detach()
        torch.testing.assert_close(global_mean(total_loss), ref_loss.detach(), rtol=1e-4, atol=2e-5)
        compare_params(model, reference)
        opt.step()
        ref_opt.step()
    compare_params(model, reference, grads=False)
