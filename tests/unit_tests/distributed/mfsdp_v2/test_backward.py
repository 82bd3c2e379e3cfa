"""Frozen units, aborted backwards and zero-size parameters."""

import copy

import pytest
import torch
import torch.nn as nn

from _dist_helpers import wrap


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
