"""Frozen units, aborted backwards, zero-size parameters, and gradients from nested graphs."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from _dist_helpers import H, build_pair, compare_params, local_rows, train_pair, world, wrap
from _mfsdp_models import BlocksAroundProjection


def _frozen_chain():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(4)]
    for layer in layers:
        layer.requires_grad_(False)
    return nn.Sequential(*layers, nn.Linear(8, 2))


def _unsharded_units(ctx):
    return [u.name for u in ctx.units if any(g.is_unsharded for g in u.parameter_groups)]


def test_frozen_units_are_resharded_as_soon_as_their_backward_is_over():
    model = _frozen_chain()
    ctx = wrap(model, list(model) + [model])
    seen = []
    # When the first layer's backward runs, the later frozen layers are already done.
    model[0].register_full_backward_hook(lambda m, gi, go: seen.append(_unsharded_units(ctx)))
    x = torch.randn(3, 8, requires_grad=True)
    model(x).sum().backward()
    assert seen == [["0"]]  # only layer 0 itself: layers 1-3 were freed after their backward
    assert _unsharded_units(ctx) == []


def test_training_continues_correctly_after_a_backward_that_raised():
    model = _frozen_chain()
    for layer in model:
        layer.requires_grad_(True)
    reference = copy.deepcopy(model)
    ctx = wrap(model, list(model) + [model])
    x = torch.randn(3, 8)

    class Abort(Exception):
        pass

    def explode(grad):
        raise Abort()

    out = model(x)
    out.register_hook(explode)
    try:
        out.sum().backward()
    except Abort:
        pass
    model.zero_grad()
    model(x).sum().backward()
    reference(x).sum().backward()
    assert _unsharded_units(ctx) == []
    expected = reference[4].weight.grad
    local = model[4].weight.grad.to_local()
    group = model[4].parameter_groups[0]
    start, end, _ = group.layout.local_piece(0, group.shard_index)
    torch.testing.assert_close(local, expected[start:end])


def test_zero_size_parameters_are_accepted():
    class WithEmpty(nn.Module):
        def __init__(self):
            super().__init__()
            self.empty_rows = nn.Parameter(torch.zeros(0, 5))
            self.empty_cols = nn.Parameter(torch.zeros(3, 0))
            self.weight = nn.Parameter(torch.ones(4, 2))

        def forward(self, x):
            return (x @ self.weight.t()).sum() + self.empty_rows.sum() + self.empty_cols.sum()

    model = WithEmpty()
    wrap(model, [model])
    shapes = {name: p.shape for name, p in model.named_parameters()}
    assert shapes == {"empty_rows": (0, 5), "empty_cols": (3, 0), "weight": (4, 2)}
    model(torch.ones(2, 2)).backward()
    assert model.empty_rows.grad.to_local().numel() == 0


@pytest.mark.parametrize("limit", [None, 0, 1, 2])
def test_reductions_in_flight_are_bounded_during_backward(limit):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    reference = copy.deepcopy(model)
    ctx = wrap(model, list(model) + [model])
    assert ctx.max_reductions_in_flight == 1  # the default: FSDP2's rule
    if limit is not None:
        ctx.max_reductions_in_flight = limit
    in_flight = []
    # By the time layer 0's backward runs, layers 5..1 have all issued their reductions.
    model[0].register_full_backward_hook(lambda m, gi, go: in_flight.append(len(ctx.backward.pending_reductions)))
    x = torch.randn(3, 8, requires_grad=True)
    model(x).sum().backward()
    assert in_flight == [1 if limit is None else limit]
    assert ctx.backward.pending_reductions == []  # the end of backward settled everything
    reference(x).sum().backward()
    for layer, ref in zip(model, reference):
        group = layer.parameter_groups[0]
        start, end, _ = group.layout.local_piece(0, group.shard_index)
        torch.testing.assert_close(layer.weight.grad.to_local(), ref.weight.grad[start:end])


class _CheckpointInsideUnit(nn.Module):
    """``outer.weight`` is used before, inside and after a reentrant checkpoint within the
    unit: the recompute's nested graph delivers every gradient of the unit first, and the
    unit's own graph still adds to ``outer.weight`` and reads the weights afterwards."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(H, H)
        self.outer = nn.Linear(H, H, bias=False)

    def _recomputed(self, h):
        return torch.tanh(self.inner(h) + F.linear(h, self.outer.weight))

    def forward(self, h):
        return self.outer(checkpoint(self._recomputed, self.outer(h), use_reentrant=True))


def _two_checkpointed_units():
    return BlocksAroundProjection([_CheckpointInsideUnit() for _ in range(2)], nn.Linear(H, H))


@pytest.mark.parametrize("placements", ["zero3", "zero2", "zero1", "no_shard"])
def test_unit_waits_for_its_own_graph_after_a_nested_one_delivered_every_gradient(placements):
    model, reference, _, _, losses, ref_losses = train_pair(_two_checkpointed_units, "sgd", microbatches=2, steps=2,
                                                            placements=placements)
    compare_params(model, reference)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)


class _RootWeightAcrossAnotherUnit(nn.Module):
    """The root's ``p`` is used first, then a child unit runs, then a reentrant checkpoint
    uses ``p`` again. Backward: the nested graph delivers all of the root's gradients (the
    root defers), the child's backward begins (the deferred root reduces), and only then
    does the first use of ``p.weight`` add its gradient: too late to be reduced."""

    def __init__(self):
        super().__init__()
        self.p = nn.Linear(H, H)
        self.child = nn.Linear(H, H)

    def units(self):
        return [self.child, self]

    def _recomputed(self, h):
        return torch.tanh(F.linear(h, self.p.weight, self.p.bias))

    def forward(self, x, late_gradient: bool = True):
        if not late_gradient:
            return self.p(self.child(x))
        h = self.child(F.linear(x, self.p.weight))
        return checkpoint(self._recomputed, h, use_reentrant=True)


def test_a_gradient_after_the_unit_reduced_raises_and_training_recovers():
    model, reference, ctx = build_pair(_RootWeightAcrossAnotherUnit, placements="zero2")
    x = torch.randn(2 * world(), H)
    with pytest.raises(RuntimeError, match="p.weight received a gradient after its unit had reduced"):
        model(local_rows(x)).square().mean().backward()
    # After zero_grad(), a backward the engine can do gives the reference's gradients.
    model.zero_grad()
    F.mse_loss(model(local_rows(x), late_gradient=False), local_rows(x)).backward()
    F.mse_loss(reference(x, late_gradient=False), x).backward()
    compare_params(model, reference, grads=True)
