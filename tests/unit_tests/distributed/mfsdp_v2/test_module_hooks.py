"""Hooks: unshard before compute, reshard and release after, prefetch of the next unit,
activation checkpointing, no-grad forwards."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from _dist_helpers import H, build_pair, local_rows, world, wrap
from _mfsdp_models import Block, CASES, Checkpointed, Nested, is_sharded_dtensor, storage_size


def _unsharded_bytes(unit):
    return sum(storage_size(g.unsharded) for g in unit.parameter_groups)


def _assert_resharded(unit, what):
    for group in unit.parameter_groups:
        assert storage_size(group.unsharded) == 0, f"{what}: {unit.name!r} keeps unsharded storage"
        assert not group.is_unsharded, f"{what}: {unit.name!r} still marked unsharded"
    for name, param in unit.named_parameters():
        assert is_sharded_dtensor(param), f"{what}: {unit.name!r}.{name} is not the sharded parameter"
    assert unit._fsdp_state.pending_unshard == [], f"{what}: {unit.name!r} has an all-gather in flight"


class Probe(nn.Module):
    """Records what its parent unit's parameters look like while the parent computes."""

    def __init__(self, owner_name, log, observe):
        super().__init__()
        self.owner_name = owner_name
        self.log = log
        self.observe = observe

    def forward(self, x):
        self.log.append((self.owner_name, self.observe()))
        return x


def test_parameters_are_unsharded_during_compute():
    model = Nested()
    log = []
    block = model.right

    def observe():
        return type(block.lin.weight), tuple(block.lin.weight.shape), storage_size(block.lin.weight)

    block.probe = Probe("right", log, observe)
    block.forward = lambda x, _b=block: _b.probe(torch.tanh(_b.lin(x)))
    ctx = wrap(model, model.units())
    model(torch.randn(2, H)).sum().backward()
    (entry,) = log
    kind, shape, nbytes = entry[1]
    assert kind is nn.Parameter and not issubclass(kind, DTensor)
    assert shape == (H, H)
    assert nbytes > 0


def test_non_root_units_are_resharded_after_forward():
    model = Nested()
    ctx = wrap(model, model.units())
    for unit in ctx.units:
        assert _unsharded_bytes(unit) == 0  # at rest
    out = model(torch.randn(2, H))
    for unit in (model.left, model.left.inner, model.right):
        _assert_resharded(unit, "after forward")
    # The root keeps its parameters for the backward that follows.
    assert _unsharded_bytes(model) > 0
    assert not isinstance(model.head.weight, DTensor)
    out.sum().backward()
    for unit in ctx.units:
        _assert_resharded(unit, "after backward")


def test_no_grad_forward_reshards_everything():
    model = Nested()
    ctx = wrap(model, model.units())
    with torch.no_grad():
        model(torch.randn(2, H))
    for unit in ctx.units:
        _assert_resharded(unit, "after a no-grad forward")


def test_unit_is_unsharded_again_for_its_backward():
    """During the backward of ``right`` (a non-root unit resharded after forward) its
    parameters are the unsharded ones again, with storage."""
    model = Nested()
    block = model.right
    seen = []

    def forward(x, _b=block):
        h = _b.lin(x)
        if h.requires_grad:
            # Fires in backward between tanh's and the linear's backward.
            h.register_hook(lambda g: seen.append((type(_b.lin.weight), _unsharded_bytes(_b))) or g)
        return torch.tanh(h)

    block.forward = forward
    ctx = wrap(model, model.units())
    out = model(torch.randn(2, H))
    _assert_resharded(block, "between forward and backward")
    out.sum().backward()
    assert len(seen) == 1
    kind, nbytes = seen[0]
    assert kind is nn.Parameter and nbytes > 0
    _assert_resharded(block, "after backward")


def test_prefetch_issues_the_next_units_all_gather():
    """While unit i computes, unit i+1 (static forward order) has its all-gather issued."""
    model = Nested()
    units = {"": model, "left": model.left, "left.inner": model.left.inner, "right": model.right}
    order = ["", "left", "left.inner", "right"]
    log = []

    def observer(name):
        def observe():
            nxt = order.index(name) + 1
            issued = None
            if nxt < len(order):
                state = units[order[nxt]]._fsdp_state
                issued = bool(state.pending_unshard) or all(g.is_unsharded for g in state.groups)
            return issued, ctx.counter.counts().get("all_gather", 0)

        return observe

    # A probe at the start of each unit's forward.
    for name, unit in units.items():
        unit.probe = Probe(name, log, observer(name))
        original = type(unit).forward
        unit.forward = lambda x, _u=unit, _f=original: _f(_u, _u.probe(x))
    ctx = wrap(model, model.units())
    assert ctx.forward_order == [units[n] for n in order]
    ctx.counter.reset()
    model(torch.randn(2, H)).sum().backward()
    assert [name for name, _ in log] == order
    for i, (name, (issued, gathers)) in enumerate(log):
        if i + 1 < len(order):
            assert issued, f"while {name!r} runs, {order[i + 1]!r} was not prefetched"
        # Own all-gather plus the prefetched next one: i + 2 gathers so far (capped at 4 units).
        assert gathers == min(i + 2, len(order)), (name, gathers)


def test_backward_prefetches_in_backward_order():
    model = Nested()
    ctx = wrap(model, model.units())
    issued = []
    for unit in ctx.units:
        for group in unit.parameter_groups:
            original = group.unshard

            def spy(_g=group, _o=original, _u=unit):
                work = _o()
                if work is not None and torch._C._current_graph_task_id() != -1:
                    issued.append(_u.name)
                return work

            group.unshard = spy
    model(torch.randn(2, H)).sum().backward()
    # The root stayed unsharded; the others are gathered in backward order (right, left, left.inner).
    assert issued == ["right", "left", "left.inner"]


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing_reshards_after_backward(use_reentrant):
    torch.manual_seed(0)
    model = Checkpointed(use_reentrant)
    ctx = wrap(model, model.units())
    x = torch.randn(2, H)
    out = model(x)
    for unit in (model.blocks[0], model.blocks[1], model.blocks[1].inner):
        _assert_resharded(unit, "after checkpointed forward")
    out.sum().backward()
    for unit in ctx.units:
        _assert_resharded(unit, "after checkpointed backward")
    for p in model.parameters():
        assert p.grad is not None and is_sharded_dtensor(p.grad)
    # A second iteration still works.
    model(x).sum().backward()
    for unit in ctx.units:
        _assert_resharded(unit, "after second checkpointed backward")


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing_recomputes_without_extra_reductions(use_reentrant):
    torch.manual_seed(0)
    model = Checkpointed(use_reentrant)
    ctx = wrap(model, model.units())
    ctx.counter.reset()
    model(torch.randn(2, H)).sum().backward()
    counts = ctx.counter.counts()
    assert counts["reduce_scatter"] == len(ctx.units)  # one reduction per unit and backward


def test_every_unit_resharded_after_backward_for_every_case():
    for name in ("nested", "sibling_roots", "parameterless_parent", "frozen", "tied", "unused_branch"):
        case = CASES[name]
        model, _, ctx = build_pair(case.build)
        x, y = case.batch(torch.Generator().manual_seed(0), 2 * world())
        case.loss(model, local_rows(x), local_rows(y)).backward()
        for unit in ctx.units:
            _assert_resharded(unit, f"{name}: after backward")


def test_unshard_and_reshard_by_hand():
    model = Nested()
    ctx = wrap(model, model.units())
    model.right.unshard()
    assert isinstance(model.right.lin.weight, nn.Parameter)
    assert not isinstance(model.right.lin.weight, DTensor)
    assert model.right.lin.weight.shape == (H, H)
    model.right.reshard()
    _assert_resharded(model.right, "after reshard()")


class _OutOfOrder(nn.Module):
    """``left.inner`` is a child of ``left`` but runs after it: execution order differs
    from the static (module-tree) order."""

    def __init__(self):
        super().__init__()
        self.left = Block()
        self.left.inner_unit = Block()
        self.right = Block()
        self.head = nn.Linear(H, H)

    def forward(self, x):
        return self.head(self.right(self.left.inner_unit(self.left(x))))


def _count_gathers_in_backward(ctx):
    counts = {}
    for unit in ctx.units:
        for group in unit.parameter_groups:
            original = group.unshard

            def spy(_o=original, _u=unit):
                work = _o()
                if work is not None and torch._C._current_graph_task_id() != -1:
                    counts[_u.name] = counts.get(_u.name, 0) + 1
                return work

            group.unshard = spy
    return counts


def test_backward_never_gathers_a_unit_whose_gradients_are_already_reduced():
    import copy

    import torch.nn.functional as F

    torch.manual_seed(0)
    model = _OutOfOrder()
    model.left.forward = lambda x, _b=model.left: torch.tanh(_b.lin(x))  # inner_unit is called by the parent
    reference = copy.deepcopy(model)
    reference.left.forward = lambda x, _b=reference.left: torch.tanh(_b.lin(x))
    ctx = wrap(model, [model.left.inner_unit, model.left, model.right, model])
    assert [u.name for u in ctx.backward_order] == ["", "right", "left", "left.inner_unit"]
    counts = _count_gathers_in_backward(ctx)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2 * world(), H, generator=g), torch.randn(2 * world(), H, generator=g)
    F.mse_loss(model(local_rows(x)), local_rows(y)).backward()
    F.mse_loss(reference(x), y).backward()
    assert all(n == 1 for n in counts.values()), counts
    assert set(counts) == {"right", "left", "left.inner_unit"}
    for unit in ctx.units:
        _assert_resharded(unit, "after out-of-order backward")
    from _mfsdp_models import expected_local, shard_infos

    ref = dict(reference.named_parameters())
    for info in shard_infos(model, ctx):
        torch.testing.assert_close(info.param.grad.to_local(), expected_local(ref[info.name].grad, info))


def test_unit_called_twice_in_one_forward():
    """A unit reused within one forward is gathered per use in forward, reduced once."""
    import copy

    import torch.nn.functional as F

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()
            self.head = nn.Linear(H, H)

        def forward(self, x):
            return self.head(self.block(self.block(x)))

    torch.manual_seed(0)
    model = Twice()
    reference = copy.deepcopy(model)
    ctx = wrap(model, [model.block, model])
    ctx.counter.reset()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2 * world(), H, generator=g), torch.randn(2 * world(), H, generator=g)
    F.mse_loss(model(local_rows(x)), local_rows(y)).backward()
    F.mse_loss(reference(x), y).backward()
    assert ctx.counter.counts()["reduce_scatter"] == 2  # block and root, once each
    for unit in ctx.units:
        _assert_resharded(unit, "after reusing a unit")
    from _mfsdp_models import expected_local, shard_infos

    ref = dict(reference.named_parameters())
    for info in shard_infos(model, ctx):
        torch.testing.assert_close(info.param.grad.to_local(), expected_local(ref[info.name].grad, info))
