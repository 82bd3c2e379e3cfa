"""Parameters at rest: Shard(0) DTensor views of one flat main_weight per group, eager
main_grad, uneven and empty shards, state_dict, persistent memory."""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from _dist_helpers import H, mesh_1d, rank, world, wrap
from _mfsdp_models import (
    Frozen,
    Nested,
    Tied,
    Tiny,
    expected_local,
    gather_full,
    is_sharded_dtensor,
    is_view_of,
    num_rows,
    shard_infos,
)
from megatron.core.distributed.mfsdp_v2 import FsdpModule


def _full_tensors(model):
    return {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


def test_parameters_are_shard0_dtensor_views_of_main_weight():
    model = Nested()
    originals = _full_tensors(model)
    ctx = wrap(model, model.units())
    infos = shard_infos(model, ctx)
    assert {i.name for i in infos} == set(originals)
    for info in infos:
        param = info.param
        assert isinstance(param, nn.Parameter) and is_sharded_dtensor(param), info.name
        assert param.device_mesh == mesh_1d()
        assert param.shape == originals[info.name].shape  # global shape
        local = param.to_local()
        # Whole rows: the local tensor has the trailing dims of the full tensor.
        assert local.shape[1:] == originals[info.name].shape[1:]
        assert local.shape[0] == info.row_end - info.row_start
        assert is_view_of(local, info.group.main_weight, info.offset), info.name
        # The values are this rank's rows of the original tensor.
        torch.testing.assert_close(local, expected_local(originals[info.name], info), rtol=0, atol=0)


def test_writes_to_main_weight_show_through_the_parameters():
    model = Nested()
    ctx = wrap(model, model.units())
    for info in shard_infos(model, ctx):
        local = info.param.to_local()
        if local.numel() == 0:
            continue
        info.group.main_weight[info.offset] = 1234.5
        assert local.reshape(-1)[0].item() == 1234.5


def test_one_flat_buffer_per_group_covers_all_local_rows():
    model = Nested()
    ctx = wrap(model, model.units())
    for unit in ctx.units:
        for group in unit.parameter_groups:
            flat = group.main_weight
            assert flat.dim() == 1 and flat.numel() == group.layout.shard_numel
            covered = torch.zeros(flat.numel(), dtype=torch.int32)
            for fp in group.fsdp_parameters:
                local = fp.sharded_param.to_local()
                assert local.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                start = (local.data_ptr() - flat.data_ptr()) // flat.element_size() if local.numel() else 0
                covered[start : start + local.numel()] += 1
            # No element is shared by two parameters.
            assert int(covered.max()) <= 1


def test_state_dict_holds_the_sharded_parameters():
    model = Nested()
    ctx = wrap(model, model.units())
    params = dict(model.named_parameters())
    state = model.state_dict()
    assert set(state) == set(params)
    for name, param in params.items():
        assert isinstance(state[name], DTensor) and is_sharded_dtensor(state[name])
        assert state[name].to_local().data_ptr() == param.to_local().data_ptr()
    kept = model.state_dict(keep_vars=True)
    assert all(kept[name] is param for name, param in params.items())


def test_rebuilt_full_parameters_equal_the_originals():
    model = Nested()
    originals = _full_tensors(model)
    ctx = wrap(model, model.units())
    for info in shard_infos(model, ctx):
        full = gather_full(info.param.to_local(), info)
        torch.testing.assert_close(full, originals[info.name], rtol=0, atol=0)


def test_every_row_lives_on_exactly_one_rank():
    """Summed over ranks, the local row counts and element counts equal the full tensor's."""
    model = Nested()
    ctx = wrap(model, model.units())
    infos = shard_infos(model, ctx)
    counts = torch.tensor([[i.param.to_local().shape[0], i.param.to_local().numel()] for i in infos])
    dist.all_reduce(counts)
    for info, (rows, numel) in zip(infos, counts.tolist()):
        assert rows == num_rows(info.param.shape), info.name
        assert numel == info.param.numel(), info.name


def test_tiny_tensors_leave_a_rank_without_rows():
    torch.manual_seed(0)
    model = Tiny()  # 3 elements: weight [1, 2] and bias [1]
    originals = _full_tensors(model)
    ctx = wrap(model, model.units())
    infos = shard_infos(model, ctx)
    local_numel = torch.tensor([sum(i.param.to_local().numel() for i in infos)])
    gathered = [torch.zeros(1, dtype=local_numel.dtype) for _ in range(world())]
    dist.all_gather(gathered, local_numel)
    assert sum(int(g) for g in gathered) == 3
    if world() == 4:
        assert min(int(g) for g in gathered) == 0  # three elements cannot cover four ranks
    for info in infos:
        local = info.param.to_local()
        assert is_sharded_dtensor(info.param)
        assert local.shape[1:] == originals[info.name].shape[1:]
        torch.testing.assert_close(local, expected_local(originals[info.name], info), rtol=0, atol=0)
        torch.testing.assert_close(gather_full(local, info), originals[info.name], rtol=0, atol=0)
    # Forward and backward work on the rank without rows, and the gradients are right.
    reference = Tiny()
    reference.load_state_dict(originals)
    x = torch.randn(4 * world(), 2)
    reference(x).pow(2).mean().backward()
    n = x.shape[0] // world()
    model(x[rank() * n : (rank() + 1) * n]).pow(2).mean().backward()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    for info in infos:
        torch.testing.assert_close(info.param.grad.to_local(), expected_local(ref_grads[info.name], info))


def test_main_grad_is_allocated_when_the_unit_is_built():
    model = Frozen()
    ctx = wrap(model, model.units())
    for unit in ctx.units:
        for group in unit.parameter_groups:
            if group.requires_grad:
                assert isinstance(group.main_grad, torch.Tensor)
                assert group.main_grad.numel() == group.layout.shard_numel
                assert storage_ok(group.main_grad)
                assert torch.count_nonzero(group.main_grad) == 0
            else:
                assert group.main_grad is None
    for param in model.parameters():
        assert param.grad is None  # nothing exposed before a backward


def storage_ok(tensor):
    return tensor.untyped_storage().size() >= tensor.numel() * tensor.element_size()


def test_main_grad_exists_right_after_fully_shard():
    from megatron.core.distributed.mfsdp_v2 import fully_shard, fully_shard_context, Placements

    with fully_shard_context(device="cpu"):
        block = nn.Linear(H, H)
        fully_shard(block, mesh=mesh_1d(), placements=Placements.zero3())
        (group,) = block.parameter_groups
        assert group.main_grad is not None and group.main_grad.numel() == group.layout.shard_numel


def test_frozen_parameters_form_their_own_group():
    model = Frozen()
    ctx = wrap(model, model.units())
    mixed_groups = model.mixed.parameter_groups
    assert sorted(g.requires_grad for g in mixed_groups) == [False, True]
    frozen_group = next(g for g in mixed_groups if not g.requires_grad)
    assert [fp.fqns for fp in frozen_group.fsdp_parameters] == [("lin.bias",)]
    assert frozen_group.main_grad is None
    assert all(not g.requires_grad and g.main_grad is None for g in model.frozen.parameter_groups)
    assert not model.mixed.lin.bias.requires_grad and model.mixed.lin.weight.requires_grad


def test_tied_weight_is_one_parameter_with_two_names():
    model = Tied()
    emb_weight = model.emb.weight
    ctx = wrap(model, model.units())
    assert model.emb.weight is model.out.weight
    assert isinstance(model.emb.weight, DTensor)
    entries = [fp for g in model.parameter_groups for fp in g.fsdp_parameters if len(fp.fqns) > 1]
    assert len(entries) == 1 and set(entries[0].fqns) == {"emb.weight", "out.weight"}
    assert entries[0].shape == emb_weight.shape
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(set(id(p) for p in model.parameters()))
    assert sum(1 for n in names if n in ("emb.weight", "out.weight")) == 1  # deduplicated


def _shapes(model):
    seen, shapes = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            shapes.append(p.shape)
    return shapes


def test_persistent_bytes_are_one_nth_plus_padding():
    model = Frozen()
    total_numel = sum(math.prod(s) for s in _shapes(model))
    trainable_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ctx = wrap(model, model.units())
    total_padding = 0
    context_expected = {"main_weight": 0, "model_weight": 0, "main_grad": 0}
    for unit in ctx.units:
        expected = {"main_weight": 0, "model_weight": 0, "main_grad": 0}
        for group in unit.parameter_groups:
            layout = group.layout
            shard_bytes = layout.shard_numel * 4  # fp32 everywhere
            expected["main_weight"] += shard_bytes
            if group.requires_grad:
                expected["main_grad"] += shard_bytes
            padding = layout.shard_numel * world() - layout.total_numel
            assert padding == sum(layout.padding_numel(s) for s in range(world()))
            max_row = max(layout.row_numels)
            # A row-aligned cut wastes less than one row per shard.
            assert 0 <= padding < world() * max_row
            assert layout.shard_numel <= math.ceil(layout.total_numel / world()) + max_row
            total_padding += padding
        assert unit.persistent_bytes() == expected, unit.name
        for key in context_expected:
            context_expected[key] += expected[key]
    assert ctx.persistent_bytes() == context_expected
    # Over all ranks: the full model once, plus the padding.
    assert context_expected["main_weight"] * world() == (total_numel + total_padding) * 4
    trainable_padding = sum(
        g.layout.shard_numel * world() - g.layout.total_numel
        for u in ctx.units for g in u.parameter_groups if g.requires_grad
    )
    assert context_expected["main_grad"] * world() == (trainable_numel + trainable_padding) * 4
    # The figure is this rank's real storage, not a bookkeeping number.
    real = sum(g.main_weight.untyped_storage().size() for u in ctx.units for g in u.parameter_groups)
    assert real == context_expected["main_weight"]


def test_persistent_bytes_do_not_grow_with_training():
    model = Nested()
    ctx = wrap(model, model.units())
    before = ctx.persistent_bytes()
    for _ in range(2):
        model(torch.randn(2, H)).sum().backward()
    assert ctx.persistent_bytes() == before


def test_wrapped_modules_keep_their_identity():
    model = Nested()
    left = model.left
    ctx = wrap(model, model.units())
    assert model.left is left
    assert isinstance(model, Nested) and isinstance(model, FsdpModule)
    assert isinstance(model.left.inner, FsdpModule)
    assert not isinstance(model.head, FsdpModule)


def test_scalar_parameter_is_replicated_in_main_weight():
    """0-d parameters have no rows to shard: every rank holds the value (Replicate)."""
    from torch.distributed.tensor import Replicate

    from _dist_helpers import build_pair, local_rows
    from _mfsdp_models import CASES

    model, reference, ctx = build_pair(CASES["scalar_parameter"].build)
    scale = model.block.scale
    assert isinstance(scale, DTensor) and tuple(scale.placements) == (Replicate(),)
    assert scale.shape == () and scale.to_local().shape == ()
    assert scale.to_local().item() == 1.5
    info = next(i for i in shard_infos(model, ctx) if i.name == "block.scale")
    assert is_view_of(scale.to_local(), info.group.main_weight, info.offset)
    for other in shard_infos(model, ctx):
        if other.name != "block.scale":
            assert is_sharded_dtensor(other.param)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2 * world(), H, generator=g), torch.randn(2 * world(), H, generator=g)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    torch.nn.functional.mse_loss(model(local_rows(x)), local_rows(y)).backward()
    # Every rank holds the full, averaged gradient of the scalar.
    torch.testing.assert_close(scale.grad.to_local(), reference.block.scale.grad)


def _spanning_views_and_splits(model):
    """Unshard a one-unit model; check every parameter's values and whether it is a view of
    the gathered buffer; return (views spanning shards, padding-split copies)."""
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    wrap(model, [model])
    group = model.parameter_groups[0]
    model.unshard()
    gathered = group.unsharded.untyped_storage()
    S = group.layout.shard_numel
    views = splits = 0
    for p in group.fsdp_parameters:
        pieces = group.layout.pieces[p.index]
        split = any(b.shard * S + b.offset != a.shard * S + a.offset + a.numel for a, b in zip(pieces, pieces[1:]))
        param = p.unsharded_param
        torch.testing.assert_close(param.detach(), reference[p.fqns[0]])
        assert (param.untyped_storage().data_ptr() == gathered.data_ptr()) == (not split), p.fqns
        views += len(pieces) > 1 and not split
        splits += split
    model.reshard()
    return views, splits


def test_unsharded_parameters_are_views_of_the_gathered_buffer_unless_padding_splits_them():
    # Tensors that run across shard boundaries with no padding in between must be views of
    # the gathered buffer (no copy, no extra memory); only padding-split ones get storage of
    # their own. The shapes were chosen (from the row layout) so that at 2 and 4 ranks the
    # first model has tensors spanning full shards and the second one padding-split ones.
    torch.manual_seed(0)
    views, _ = _spanning_views_and_splits(nn.Sequential(nn.Linear(H, 3 * H), nn.Linear(3 * H, H)))
    assert views >= (world() > 1)
    _, splits = _spanning_views_and_splits(nn.Sequential(nn.Linear(H, 3 * H), nn.Linear(3 * H, H), nn.Linear(3 * H, 3)))
    assert splits >= (world() > 1)
