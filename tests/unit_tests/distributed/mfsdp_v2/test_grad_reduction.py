"""Gradients: averaged over ranks, views of main_grad, accumulation and zero_grad semantics,
unused parameters. Every expected value comes from the single-process reference."""

import copy

import pytest
import torch
import torch.nn.functional as F

from _dist_helpers import H, build_pair, local_rows, mesh_1d, world, wrap
from _mfsdp_models import (
    CASES,
    Nested,
    UnusedBranch,
    expected_local,
    gather_full,
    is_sharded_dtensor,
    is_view_of,
    shard_infos,
    storage_size,
)
from megatron.core.distributed.mfsdp_v2 import fully_shard_optimizer, microbatch


def _batch(seed, rows_per_rank=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows_per_rank * world(), H, generator=g), torch.randn(rows_per_rank * world(), H, generator=g)


def _ref_backward(reference, x, y):
    F.mse_loss(reference(x), y).backward()


def _backward(model, x, y, ctx=None, is_last=True):
    if ctx is None:
        F.mse_loss(model(local_rows(x)), local_rows(y)).backward()
    else:
        with microbatch(ctx, is_last=is_last):
            F.mse_loss(model(local_rows(x)), local_rows(y)).backward()


def _ref_grads(reference):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in reference.named_parameters()}


def _assert_grads(model, ctx, expected, what):
    for info in shard_infos(model, ctx):
        grad = info.param.grad
        assert grad is not None, f"{what}: {info.name} has no gradient"
        torch.testing.assert_close(
            grad.to_local(), expected_local(expected[info.name], info), rtol=1e-5, atol=1e-6,
            msg=lambda m: f"{what}: {info.name}: {m}",
        )


def test_gradients_are_averaged_over_ranks():
    model, reference, ctx = build_pair(CASES["nested"].build)
    x, y = _batch(1)
    _ref_backward(reference, x, y)
    _backward(model, x, y)
    _assert_grads(model, ctx, _ref_grads(reference), "one backward")
    # The same, rebuilt from every rank's shard with our own all-gather.
    ref = dict(reference.named_parameters())
    for info in shard_infos(model, ctx):
        torch.testing.assert_close(gather_full(info.param.grad.to_local(), info), ref[info.name].grad)


def test_grad_is_a_dtensor_view_of_main_grad():
    model, reference, ctx = build_pair(CASES["nested"].build)
    x, y = _batch(1)
    _backward(model, x, y)
    for info in shard_infos(model, ctx):
        grad = info.param.grad
        assert is_sharded_dtensor(grad), info.name
        assert grad.shape == info.param.shape
        assert grad.to_local().shape == info.param.to_local().shape
        assert is_view_of(grad.to_local(), info.group.main_grad, info.offset), info.name
    # Writing through main_grad shows in .grad.
    for info in shard_infos(model, ctx):
        if info.param.to_local().numel():
            info.group.main_grad[info.offset] = -77.0
            assert info.param.grad.to_local().reshape(-1)[0].item() == -77.0


def test_successive_backwards_accumulate():
    model, reference, ctx = build_pair(CASES["nested"].build)
    for seed in (1, 2, 3):
        x, y = _batch(seed)
        _ref_backward(reference, x, y)
        _backward(model, x, y)
    _assert_grads(model, ctx, _ref_grads(reference), "three backwards")


def test_microbatches_accumulate_until_the_last():
    model, reference, ctx = build_pair(CASES["nested"].build)
    seeds = (1, 2, 3)
    for i, seed in enumerate(seeds):
        x, y = _batch(seed)
        _ref_backward(reference, x, y)
        _backward(model, x, y, ctx, is_last=i == len(seeds) - 1)
    _assert_grads(model, ctx, _ref_grads(reference), "three microbatches")


def test_zero_grad_set_to_none_makes_the_next_backward_overwrite():
    model, reference, ctx = build_pair(CASES["nested"].build)
    opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    x, y = _batch(1)
    _backward(model, x, y)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    x2, y2 = _batch(2)
    _ref_backward(reference, x2, y2)  # the reference only ever sees the second batch
    _backward(model, x2, y2)
    _assert_grads(model, ctx, _ref_grads(reference), "after zero_grad(set_to_none=True)")
    # main_grad itself holds only the new gradient (nothing left from the first backward).
    for info in shard_infos(model, ctx):
        local = info.group.main_grad.narrow(0, info.offset, info.param.to_local().numel())
        torch.testing.assert_close(local.view_as(info.param.to_local()), expected_local(
            dict(reference.named_parameters())[info.name].grad, info), rtol=1e-5, atol=1e-6)


def test_zero_grad_set_to_none_over_microbatches():
    """After zero_grad(set_to_none=True) only the *first* microbatch overwrites."""
    model, reference, ctx = build_pair(CASES["nested"].build)
    opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    x, y = _batch(1)
    _backward(model, x, y)
    opt.zero_grad(set_to_none=True)
    for i, seed in enumerate((2, 3)):
        x, y = _batch(seed)
        _ref_backward(reference, x, y)
        _backward(model, x, y, ctx, is_last=i == 1)
    _assert_grads(model, ctx, _ref_grads(reference), "two microbatches after set_to_none")


def test_module_zero_grad_sets_to_none_too():
    model, reference, ctx = build_pair(CASES["nested"].build)
    x, y = _batch(1)
    _backward(model, x, y)
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    x2, y2 = _batch(2)
    _ref_backward(reference, x2, y2)
    _backward(model, x2, y2)
    _assert_grads(model, ctx, _ref_grads(reference), "after module.zero_grad()")


def test_zero_grad_without_set_to_none_accumulates_onto_the_zeroed_buffer():
    model, reference, ctx = build_pair(CASES["nested"].build)
    opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    x, y = _batch(1)
    _backward(model, x, y)
    opt.zero_grad(set_to_none=False)
    for info in shard_infos(model, ctx):
        assert info.param.grad is not None
        assert torch.count_nonzero(info.param.grad.to_local()) == 0
    assert all(torch.count_nonzero(g.main_grad) == 0 for u in ctx.units for g in u.parameter_groups)
    # Put a known value in .grad: the next backward must add onto it, not replace it.
    for p in model.parameters():
        p.grad.to_local().fill_(0.5)
    x2, y2 = _batch(2)
    _ref_backward(reference, x2, y2)
    _backward(model, x2, y2)
    expected = {n: g + 0.5 for n, g in _ref_grads(reference).items()}
    _assert_grads(model, ctx, expected, "after zero_grad(set_to_none=False)")


def test_grads_survive_the_next_forward():
    """A forward alone (no backward) leaves the exposed gradients as they were."""
    model, reference, ctx = build_pair(CASES["nested"].build)
    x, y = _batch(1)
    _ref_backward(reference, x, y)
    _backward(model, x, y)
    with torch.no_grad():
        model(torch.randn(2, H))
    _assert_grads(model, ctx, _ref_grads(reference), "after a no-grad forward")


def test_unused_branch_gets_a_zero_gradient_and_is_resharded():
    model, reference, ctx = build_pair(CASES["unused_branch"].build)
    x, y = _batch(1)
    _ref_backward(reference, x, y)
    _backward(model, x, y)
    ref = _ref_grads(reference)
    assert ref["unused.lin.weight"] is None and ref["b.spare.weight"] is None  # premise
    expected = {n: (g if g is not None else torch.zeros_like(dict(reference.named_parameters())[n]))
                for n, g in ref.items()}
    _assert_grads(model, ctx, expected, "unused branch")
    for unit in (model.unused, model.b):
        for group in unit.parameter_groups:
            assert storage_size(group.unsharded) == 0
            assert all(is_sharded_dtensor(fp.sharded_param) for fp in group.fsdp_parameters)
        for param in unit.parameters():
            assert is_sharded_dtensor(param)
    # A second backward still works and accumulates (zero for the unused parts).
    x2, y2 = _batch(2)
    _ref_backward(reference, x2, y2)
    _backward(model, x2, y2)
    ref = _ref_grads(reference)
    expected = {n: (g if g is not None else torch.zeros_like(dict(reference.named_parameters())[n]))
                for n, g in ref.items()}
    _assert_grads(model, ctx, expected, "unused branch, second backward")


def test_unused_unit_is_reduced_at_the_end_of_backward(monkeypatch):
    """The unused unit's reduction happens (once per backward) even though no gradient arrived."""
    from megatron.core.distributed.mfsdp_v2 import work as comm

    model, reference, ctx = build_pair(CASES["unused_branch"].build)
    groups = {id(g): u for u in ctx.units for g in u.parameter_groups}
    reduced = []
    original = comm.reduce_scatter

    def spy(output, input, group, **kwargs):
        reduced.append(output.numel())
        return original(output, input, group, **kwargs)

    monkeypatch.setattr(comm, "reduce_scatter", spy)
    x, y = _batch(1)
    _backward(model, x, y)
    trainable_groups = sum(1 for u in ctx.units for g in u.parameter_groups if g.requires_grad)
    assert len(reduced) == trainable_groups
    assert len(groups) == trainable_groups


def test_grad_divisor_divides_on_top_of_the_rank_average():
    import copy

    from megatron.core.distributed.mfsdp_v2 import Placements, fully_shard, fully_shard_context

    torch.manual_seed(0)
    model = Nested()
    reference = copy.deepcopy(model)
    with fully_shard_context(device="cpu") as ctx:
        for unit in model.units():
            fully_shard(unit, mesh=mesh_1d(), placements=Placements.zero3(), grad_divisor=4.0)
    x, y = _batch(1)
    _ref_backward(reference, x, y)
    _backward(model, x, y)
    expected = {n: g / 4.0 for n, g in _ref_grads(reference).items()}
    _assert_grads(model, ctx, expected, "grad_divisor=4")
