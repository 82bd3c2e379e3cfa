"""The construction scope: streams, finalization (roots, names, static orders), scope errors."""

import pytest
import torch
import torch.nn as nn

from _dist_helpers import H, mesh_1d, wrap
from _mfsdp_models import Block, Nested, Siblings
from megatron.core.distributed.mfsdp_v2 import (
    FsdpContext,
    Placements,
    current_fully_shard_context,
    fully_shard,
    fully_shard_context,
    microbatch,
)
from megatron.core.distributed.mfsdp_v2 import work as comm


def _record_streams(monkeypatch, kind):
    """Record the ``stream`` of every call of ``work.<kind>`` the engine makes."""
    seen = []
    original = getattr(comm, kind)

    def spy(*args, **kwargs):
        seen.append(kwargs["stream"])
        return original(*args, **kwargs)

    monkeypatch.setattr(comm, kind, spy)
    return seen


def _train_once(model):
    x = torch.randn(2, H)
    model(x).sum().backward()


# Streams -------------------------------------------------------------------------------


def test_streams_exist_as_soon_as_the_scope_opens():
    with fully_shard_context(device="cpu") as ctx:
        assert isinstance(ctx, FsdpContext)
        assert current_fully_shard_context() is ctx
        allgather, reduce_scatter = ctx.allgather_stream, ctx.reduce_scatter_stream
        assert allgather is not None and reduce_scatter is not None
        for stream in (allgather, reduce_scatter):
            for method in ("wait_stream", "wait_event", "record_event", "synchronize"):
                assert callable(getattr(stream, method))
        assert allgather is not reduce_scatter  # two streams unless unified
        model = Block()
        fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3())
    assert current_fully_shard_context() is None
    # Built once: the same objects after the scope closed.
    assert ctx.allgather_stream is allgather
    assert ctx.reduce_scatter_stream is reduce_scatter


def test_unify_communication_stream_gives_one_stream():
    with fully_shard_context(device="cpu", unify_communication_stream=True) as ctx:
        assert ctx.allgather_stream is ctx.reduce_scatter_stream


def test_every_unit_uses_the_contexts_allgather_stream(monkeypatch):
    model = Nested()
    ctx = wrap(model, model.units())
    seen = _record_streams(monkeypatch, "all_gather")
    _train_once(model)
    # Every parameterized unit gathered at least once, always on the one allgather stream.
    assert len(seen) >= len(ctx.units)
    assert all(stream is ctx.allgather_stream for stream in seen)
    for unit in ctx.units:
        assert unit.context is ctx
        assert unit.context.allgather_stream is ctx.allgather_stream
        for group in unit.parameter_groups:
            assert group.resources.allgather_stream is ctx.allgather_stream


def test_every_unit_uses_the_contexts_reduce_scatter_stream(monkeypatch):
    model = Nested()
    ctx = wrap(model, model.units())
    seen = _record_streams(monkeypatch, "reduce_scatter")
    _train_once(model)
    assert len(seen) == len(ctx.units)  # one reduction per unit (one group each)
    assert all(stream is ctx.reduce_scatter_stream for stream in seen)
    assert ctx.reduce_scatter_stream is not ctx.allgather_stream
    for unit in ctx.units:
        for group in unit.parameter_groups:
            assert group.resources.reduce_scatter_stream is ctx.reduce_scatter_stream


def test_unified_stream_carries_both_collectives(monkeypatch):
    model = Nested()
    ctx = wrap(model, model.units(), unify_communication_stream=True)
    gathers = _record_streams(monkeypatch, "all_gather")
    reductions = _record_streams(monkeypatch, "reduce_scatter")
    _train_once(model)
    assert gathers and reductions
    assert all(s is ctx.allgather_stream for s in gathers + reductions)


def test_two_contexts_have_their_own_streams():
    a, b = Block(), Block()
    ctx_a = wrap(a, [a])
    ctx_b = wrap(b, [b])
    assert ctx_a.allgather_stream is not ctx_b.allgather_stream
    assert ctx_a.reduce_scatter_stream is not ctx_b.reduce_scatter_stream
    assert a.context is ctx_a and b.context is ctx_b


# Finalization ---------------------------------------------------------------------------


def test_nested_units_orders_and_names():
    model = Nested()
    ctx = wrap(model, model.units())
    m, left, inner, right = model, model.left, model.left.inner, model.right
    assert ctx.finalized
    assert ctx.units == [inner, left, right, m]  # registration order
    assert ctx.roots == [m]
    assert [u.name for u in (m, left, inner, right)] == ["", "left", "left.inner", "right"]
    assert ctx.forward_order == [m, left, inner, right]
    assert ctx.backward_order == [m, right, left, inner]
    assert m.is_root() and not left.is_root() and not inner.is_root()


def test_sibling_roots_in_registration_order():
    model = Siblings()
    # Registration order b, then a: roots follow it, not the module tree or execution order.
    ctx = wrap(model, [model.b.inner, model.b, model.a])
    a, b, inner = model.a, model.b, model.b.inner
    assert ctx.roots == [b, a]
    assert [a.name, b.name, inner.name] == ["", "", "inner"]
    assert ctx.forward_order == [b, inner, a]
    assert ctx.backward_order == [a, b, inner]
    assert a.is_root() and b.is_root() and not inner.is_root()


def test_names_follow_named_modules_of_the_root():
    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = nn.Sequential(Block(), nn.Sequential(nn.Identity(), Block()))

        def forward(self, x):
            return self.stack(x)

    model = Deep()
    units = [model.stack[1][1], model.stack[0], model]
    ctx = wrap(model, units)
    assert [u.name for u in units] == ["stack.1.1", "stack.0", ""]
    assert ctx.forward_order == [model, model.stack[0], model.stack[1][1]]
    assert ctx.backward_order == [model, model.stack[1][1], model.stack[0]]


def test_fully_shard_returns_the_same_module():
    with fully_shard_context(device="cpu") as ctx:
        model = Block()
        assert fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3()) is model
    assert ctx.units == [model] and ctx.roots == [model]


def test_nothing_is_final_inside_the_scope():
    with fully_shard_context(device="cpu") as ctx:
        model = Nested()
        for unit in model.units():
            fully_shard(unit, mesh=mesh_1d(), placements=Placements.zero3())
        assert not ctx.finalized
        assert ctx.roots == [] and ctx.forward_order == [] and ctx.backward_order == []
        assert model.name is None
    assert ctx.finalized and model.name == ""


# Scope errors ----------------------------------------------------------------------------


def test_fully_shard_outside_a_scope():
    model = Block()
    params = list(model.parameters())
    with pytest.raises(RuntimeError, match="inside fully_shard_context"):
        fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3())
    assert all(a is b for a, b in zip(model.parameters(), params)) and type(model) is Block


def test_nested_scopes_are_refused():
    with fully_shard_context(device="cpu") as outer:
        with pytest.raises(RuntimeError, match="does not support nesting"):
            with fully_shard_context(device="cpu"):
                pass
        # The outer scope is still the active one and still usable.
        assert current_fully_shard_context() is outer
        model = Block()
        fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3())
    assert outer.finalized


def test_forward_inside_the_scope_is_refused():
    with fully_shard_context(device="cpu"):
        model = Block()
        fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3())
        with pytest.raises(RuntimeError, match="Exit fully_shard_context"):
            model(torch.randn(2, H))
    model(torch.randn(2, H)).sum().backward()  # fine once the scope is closed


def test_microbatch_inside_the_scope_is_refused():
    with fully_shard_context(device="cpu") as ctx:
        model = Block()
        fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3())
        with pytest.raises(RuntimeError, match="Exit fully_shard_context"):
            with microbatch(ctx, is_last=True):
                pass
    with microbatch(ctx, is_last=True):
        model(torch.randn(2, H)).sum().backward()


def test_scope_left_through_an_exception_is_not_finalized():
    model = Nested()
    with pytest.raises(KeyError):
        with fully_shard_context(device="cpu") as ctx:
            for unit in model.units():
                fully_shard(unit, mesh=mesh_1d(), placements=Placements.zero3())
            raise KeyError("user error while building")
    assert current_fully_shard_context() is None
    assert not ctx.finalized and ctx.roots == [] and ctx.forward_order == []
    with pytest.raises(RuntimeError, match="Exit fully_shard_context"):
        model(torch.randn(2, H))
    with pytest.raises(RuntimeError, match="Exit fully_shard_context"):
        with microbatch(ctx, is_last=True):
            pass
    # A new scope can be opened afterwards.
    with fully_shard_context(device="cpu") as fresh:
        pass
    assert fresh.finalized


def test_microbatch_restores_the_flag():
    model = Block()
    ctx = wrap(model, [model])
    assert ctx.is_last_microbatch is True
    with microbatch(ctx, is_last=False):
        assert ctx.is_last_microbatch is False
        model(torch.randn(2, H)).sum().backward()
    assert ctx.is_last_microbatch is True
    with pytest.raises(TypeError, match="FsdpContext"):
        with microbatch(object(), is_last=True):
            pass
