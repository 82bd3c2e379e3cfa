"""Every user error: its type and message, and that a failed fully_shard changes nothing."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from _dist_helpers import H, mesh_1d, wrap
from _mfsdp_models import Block, Nested
from megatron.core.distributed.mfsdp_v2 import (
    FsdpModule,
    Placements,
    fully_shard,
    fully_shard_context,
)


def _snapshot(module):
    """Everything fully_shard may touch, by identity."""
    return {
        "class": type(module),
        "params": [(name, id(p)) for m in module.modules() for name, p in m._parameters.items()],
        "modules": [id(m) for m in module.modules()],
        "hooks": [
            (len(m._forward_pre_hooks), len(m._forward_hooks), len(m._load_state_dict_pre_hooks),
             len(m._backward_hooks), len(m._state_dict_hooks))
            for m in module.modules()
        ],
        "fsdp_state": [hasattr(m, "_fsdp_state") for m in module.modules()],
        "classes": [type(m) for m in module.modules()],
    }


def _assert_unchanged(module, before, ctx=None, units_before=None):
    after = _snapshot(module)
    assert after == before
    assert not isinstance(module, FsdpModule)
    if ctx is not None:
        assert len(ctx.units) == units_before


def _trains(model, ctx):
    """The module can still be wrapped and trained normally afterwards."""
    model(torch.randn(2, H)).sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())


def test_fully_shard_outside_a_scope_raises():
    model = Block()
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match="inside fully_shard_context"):
        fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3())
    _assert_unchanged(model, before)


def test_nested_scope_raises():
    with fully_shard_context(device="cpu"):
        with pytest.raises(RuntimeError, match="does not support nesting"):
            with fully_shard_context(device="cpu"):
                pass


def test_forward_before_the_scope_exits_raises():
    with fully_shard_context(device="cpu") as ctx:
        model = Block()
        fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3())
        with pytest.raises(RuntimeError, match="Exit fully_shard_context"):
            model(torch.randn(2, H))
    _trains(model, ctx)


def test_module_containing_a_unit_of_another_context_raises():
    model = Nested()
    other = wrap(model.left, [model.left])
    before = _snapshot(model)
    with fully_shard_context(device="cpu") as ctx:
        fully_shard(model.right, mesh=mesh_1d(), placements=Placements.zero3())
        with pytest.raises(ValueError, match="another fully_shard_context") as info:
            fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3())
        assert "left" in str(info.value)  # names the offending submodule
    assert model.left.context is other
    assert type(model) is Nested and not hasattr(model, "_fsdp_state")
    assert len(ctx.units) == 1


def test_wrapping_twice_raises():
    with fully_shard_context(device="cpu") as ctx:
        model = Block()
        fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3())
        params = [id(p) for p in model.parameters()]
        with pytest.raises(ValueError, match="already managed by FSDP"):
            fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3())
        assert [id(p) for p in model.parameters()] == params
    assert ctx.units == [model]
    with fully_shard_context(device="cpu"):
        with pytest.raises(ValueError, match="already managed by FSDP"):
            fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3())
    _trains(model, ctx)


class _TiedAcrossUnits(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Block()
        self.b = Block()
        self.b.lin.weight = self.a.lin.weight

    def forward(self, x):
        return self.b(self.a(x))


def test_parameter_owned_by_two_units_raises_naming_it():
    model = _TiedAcrossUnits()
    with fully_shard_context(device="cpu") as ctx:
        fully_shard(model.a, mesh=mesh_1d(), placements=Placements.zero3())
        before = _snapshot(model.b)
        with pytest.raises(ValueError, match=r"'lin\.weight'"):
            fully_shard(model.b, mesh=mesh_1d(), placements=Placements.zero3())
        _assert_unchanged(model.b, before, ctx, 1)
        before = _snapshot(model)
        with pytest.raises(ValueError, match=r"'b\.lin\.weight'"):
            fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3())
        assert type(model) is _TiedAcrossUnits and not hasattr(model, "_fsdp_state")
        assert len(ctx.units) == 1


def test_load_state_dict_assign_raises():
    model = Nested()
    ctx = wrap(model, model.units())
    params = {n: p for n, p in model.named_parameters()}
    state = {n: p.detach().clone() for n, p in params.items()}
    with pytest.raises(RuntimeError, match=r"load_state_dict\(assign=True\)"):
        model.load_state_dict(state, assign=True)
    assert all(p is params[n] for n, p in model.named_parameters())
    with pytest.raises(RuntimeError, match=r"load_state_dict\(assign=True\)"):
        model.left.load_state_dict(model.left.state_dict(), assign=True)
    assert all(p is params[n] for n, p in model.named_parameters())


def test_load_state_dict_assign_raises_below_a_parent_that_is_no_unit():
    from _mfsdp_models import Siblings

    model = Siblings()
    wrap(model, model.units())
    params = {n: p for n, p in model.named_parameters()}
    state = {n: p.detach().clone() for n, p in params.items()}
    with pytest.raises(RuntimeError, match=r"load_state_dict\(assign=True\)"):
        model.load_state_dict(state, assign=True)
    assert all(p is params[n] for n, p in model.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_unsupported_dtype_raises_and_changes_nothing(dtype):
    model = Block()
    model.extra = nn.Parameter(torch.zeros(3, dtype=dtype), requires_grad=dtype.is_floating_point)
    before = _snapshot(model)
    with fully_shard_context(device="cpu") as ctx:
        with pytest.raises(NotImplementedError, match="float32, bfloat16 and float16") as info:
            fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3())
        assert "extra" in str(info.value)
        _assert_unchanged(model, before, ctx, 0)
        del model.extra
        fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3())  # nothing stale from the failure
    _trains(model, ctx)


def test_shard1_raises_and_changes_nothing():
    model = Block()
    before = _snapshot(model)
    shard1 = Placements((0,), (Shard(1),), (Shard(1),), (Shard(1),))
    with fully_shard_context(device="cpu") as ctx:
        with pytest.raises(NotImplementedError, match=r"Shard\(0\)"):
            fully_shard(model, mesh=mesh_1d(), placements=shard1)
        _assert_unchanged(model, before, ctx, 0)
        mixed = Placements((0,), (Shard(0),), (Replicate(),), (Shard(0),))
        with pytest.raises(NotImplementedError, match="zero3"):
            fully_shard(model, mesh=mesh_1d(), placements=mixed)
        _assert_unchanged(model, before, ctx, 0)
        fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3())
    _trains(model, ctx)


def test_placements_length_must_match_dp_axes():
    with pytest.raises(ValueError, match="dp_axes"):
        Placements((0,), (Shard(0), Shard(0)), (Shard(0),), (Shard(0),))
    with pytest.raises(ValueError, match="dp_axes"):
        Placements((0, 1), (Replicate(), Shard(0)), (Shard(0),), (Replicate(), Shard(0)))


def test_dp_axis_not_in_mesh_raises_and_changes_nothing():
    model = Block()
    before = _snapshot(model)
    with fully_shard_context(device="cpu") as ctx:
        with pytest.raises(ValueError, match="out of range"):
            fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3(dp_axis=1))
        _assert_unchanged(model, before, ctx, 0)


def test_wrong_argument_types_raise():
    with fully_shard_context(device="cpu") as ctx:
        model = Block()
        with pytest.raises(TypeError, match="Placements"):
            fully_shard(model, mesh=mesh_1d(), placements="zero3")
        with pytest.raises(TypeError, match="DeviceMesh"):
            fully_shard(model, mesh=None, placements=Placements.zero3())
        with pytest.raises(TypeError, match="nn.Module"):
            fully_shard(torch.zeros(2), mesh=mesh_1d(), placements=Placements.zero3())
        with pytest.raises(ValueError, match="grad_divisor"):
            fully_shard(model, mesh=mesh_1d(), placements=Placements.zero3(), grad_divisor=0)
        assert len(ctx.units) == 0 and type(model) is Block


def test_new_parameters_may_reuse_the_address_of_a_wrapped_original():
    """A parameter built after an earlier unit was wrapped is not 'owned' by that unit just
    because CPython reused the address of that unit's freed original parameter."""
    with fully_shard_context(device="cpu") as ctx:
        first = nn.Linear(H, H)
        freed_ids = {id(first.weight), id(first.bias)}
        fully_shard(first, mesh=mesh_1d(), placements=Placements.zero3())
        keep, reused = [], None
        for _ in range(10000):
            p = nn.Parameter(torch.zeros(2))
            keep.append(p)
            if id(p) in freed_ids:
                reused = p
                break
        # CPython hands a freed object's memory to the next object of its size.
        assert reused is not None
        holder = nn.Module()
        holder.weight = reused
        fully_shard(holder, mesh=mesh_1d(), placements=Placements.zero3())
    assert ctx.units == [first, holder]
