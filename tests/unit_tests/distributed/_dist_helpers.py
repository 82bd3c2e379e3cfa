"""Helpers every distributed test folder shares (1, 2 or 4 gloo ranks).

``conftest.py`` of this folder puts it on ``sys.path``, so test modules import it by name:
``from _dist_helpers import wrap, train_pair``. Nothing here asserts except ``check`` and
``compare_params``, which are the comparisons themselves. Expected values never come from
the engine under test: they come from a plain single-process reference model (a deepcopy
taken before ``fully_shard``, trained on the global batch) or from arithmetic on the
original tensors. Full tensors are rebuilt with this file's own all-gathers.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from megatron.core.distributed.mfsdp_v2 import (
    Placements,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
    microbatch,
)

H = 8  # input/output width of the feature batches
ROWS_PER_RANK = 2  # rows of one microbatch each rank sees


def world() -> int:
    return dist.get_world_size()


def rank() -> int:
    return dist.get_rank()


# --------------------------------------------------------------------------------------
# Process groups that outlive one test
# --------------------------------------------------------------------------------------
# Every gloo group has a thread that wakes every 10 ms for as long as the group lives, so
# groups left behind by earlier tests slow every later one (at 4 ranks on 2 cores, the run
# used to end with ~1800 threads per rank and the load average near 1000). conftest.py
# destroys the groups a test creates when it ends, except those made for a module cache
# below, which live until the end of the test module.

_MODULE_CACHES: List[dict] = []
_KEPT_GROUPS: set = set()


def live_groups() -> set:
    """Every process group of this process but the world (torch's registry, read only)."""
    return {g for g in dist.distributed_c10d._world.pg_map if g is not dist.group.WORLD}


def module_cache() -> dict:
    """A dict emptied at the end of every test module (fill it inside ``kept_groups()``)."""
    cache: dict = {}
    _MODULE_CACHES.append(cache)
    return cache


@contextlib.contextmanager
def kept_groups():
    """Process groups created inside this block live until the end of the test module
    (for what a module cache keeps), not only until the end of the test."""
    before = live_groups()
    try:
        yield
    finally:
        _KEPT_GROUPS.update(live_groups() - before)


def destroy_groups(groups, keep_module_groups: bool) -> None:
    """Destroy ``groups`` (all ranks call it after a barrier); with ``keep_module_groups``,
    leave those made for a module cache."""
    destroyed = False
    for group in groups:
        if keep_module_groups and group in _KEPT_GROUPS:
            continue
        _KEPT_GROUPS.discard(group)
        dist.destroy_process_group(group)
        destroyed = True
    if destroyed:
        # torch's DTensor caches compare meshes by layout, not by group, and their answers
        # hold the mesh they were computed on: a later mesh of the same layout would be
        # handed this test's mesh, whose groups are gone. torch's own way to empty them:
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        clear_redistribute_planner_cache()
        # A group's threads end when its last reference goes; models are reference cycles,
        # so without a collection they (and the groups they hold) wait for the next one.
        gc.collect()


def forget_module_caches() -> None:
    for cache in _MODULE_CACHES:
        cache.clear()


# --------------------------------------------------------------------------------------
# Meshes and wrapping
# --------------------------------------------------------------------------------------

_MESHES: Dict[Tuple, DeviceMesh] = module_cache()


def mesh_1d(group=None) -> DeviceMesh:
    """The 1-D mesh over the whole world (built once per module), or over ``group``."""
    if group is not None:
        return DeviceMesh.from_group(group, "cpu")
    key = (world(),)
    if key not in _MESHES:
        with kept_groups():
            _MESHES[key] = init_device_mesh("cpu", key)
    return _MESHES[key]


def mesh_2d(shape: Tuple[int, int]) -> DeviceMesh:
    """A 2-D mesh with dims named ("outer", "inner") (built once per shape and module)."""
    key = tuple(shape)
    if key not in _MESHES:
        with kept_groups():
            _MESHES[key] = init_device_mesh("cpu", key, mesh_dim_names=("outer", "inner"))
    return _MESHES[key]


def wrap(model: nn.Module, units: Optional[Sequence[nn.Module]] = None, mesh: Optional[DeviceMesh] = None,
         placements=None, policy=None, *, grad_divisor=1, cast=None, **context_kwargs):
    """``fully_shard`` every module of ``units`` (default ``model.units()``; children first)
    in one ``fully_shard_context(device="cpu", **context_kwargs)`` scope.

    ``mesh`` defaults to the 1-D world mesh, ``placements`` to ZeRO-3; a string names a
    ``Placements`` constructor (default axes). ``cast``: a dtype the model is moved to
    inside the scope, before any unit is built."""
    mesh = mesh_1d() if mesh is None else mesh
    if placements is None:
        placements = Placements.zero3()
    elif isinstance(placements, str):
        placements = getattr(Placements, placements)()
    with fully_shard_context(device="cpu", **context_kwargs) as ctx:
        if cast is not None:
            model.to(cast)
        for unit in model.units() if units is None else units:
            fully_shard(unit, mesh=mesh, placements=placements, mixed_precision_policy=policy,
                        grad_divisor=grad_divisor)
    return ctx


# --------------------------------------------------------------------------------------
# Training against a reference
# --------------------------------------------------------------------------------------


def build_pair(build: Callable[[], nn.Module], *, seed: int = 0, **wrap_kwargs):
    """(model, reference, context): the reference is a deepcopy taken before wrapping."""
    torch.manual_seed(seed)
    model = build()
    reference = copy.deepcopy(model)
    ctx = wrap(model, **wrap_kwargs)
    return model, reference, ctx


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)
    if kind in ("adamw_foreach", "adamw_loop"):  # torch's implementations, chosen explicitly
        return torch.optim.AdamW(params, lr=0.02, weight_decay=0.1, foreach=kind == "adamw_foreach")
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=0.02, weight_decay=0.1, fused=True)
    raise ValueError(kind)


def local_rows(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a global batch (equal slices)."""
    n = tensor.shape[0] // world()
    return tensor[rank() * n : (rank() + 1) * n]


def global_mean(value: torch.Tensor) -> torch.Tensor:
    """All-reduce SUM then divide: the mean over ranks of a scalar."""
    value = value.detach().clone().float()
    dist.all_reduce(value)
    return value / world()


def feature_batch(generator: torch.Generator, rows: int, in_features: int = H, out_features: int = H):
    """(x, y) of random features: one global microbatch."""
    return torch.randn(rows, in_features, generator=generator), torch.randn(rows, out_features, generator=generator)


def batches(generator: torch.Generator, microbatches: int, in_features: int = H, out_features: int = H):
    """``microbatches`` global feature microbatches of ``ROWS_PER_RANK`` rows per rank."""
    return [feature_batch(generator, ROWS_PER_RANK * world(), in_features, out_features) for _ in range(microbatches)]


def mse(model: nn.Module, x, y):
    return F.mse_loss(model(x), y)


def zero_missing_grads(model: nn.Module) -> None:
    """The engine's contract for unused trainable parameters: their gradient is zero, not None."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def train_pair(build: Callable[[], nn.Module], optimizer: str, microbatches: int, steps: int, *,
               batch=feature_batch, loss=mse, set_to_none: bool = True, seed: int = 0, **wrap_kwargs):
    """Train the wrapped model and the reference side by side: the reference on the whole
    global batch at once, every rank on its slice of each microbatch.

    ``batch(generator, rows) -> (x, y)``; ``loss(model, x, y)``. Returns
    (model, reference, ctx, opt, losses, ref_losses); the losses are averaged over ranks."""
    model, reference, ctx = build_pair(build, seed=seed, **wrap_kwargs)
    opt = fully_shard_optimizer(make_optimizer(optimizer, model.parameters()))
    ref_opt = make_optimizer(optimizer, reference.parameters())
    generator = torch.Generator().manual_seed(seed + 1)  # same batches on every rank
    losses, ref_losses = [], []
    for _ in range(steps):
        mbs = [batch(generator, ROWS_PER_RANK * world()) for _ in range(microbatches)]
        ref_opt.zero_grad(set_to_none=set_to_none)
        x = torch.cat([b[0] for b in mbs])
        y = torch.cat([b[1] for b in mbs])
        ref_loss = loss(reference, x, y)
        ref_loss.backward()
        zero_missing_grads(reference)
        ref_opt.step()
        ref_losses.append(ref_loss.detach())
        opt.zero_grad(set_to_none=set_to_none)
        total = torch.zeros(())
        for i, (xb, yb) in enumerate(mbs):
            with microbatch(ctx, is_last=i == microbatches - 1):
                step_loss = loss(model, local_rows(xb), local_rows(yb)) / microbatches
                step_loss.backward()
            total += step_loss.detach().float()
        opt.step()
        losses.append(global_mean(total))
    return model, reference, ctx, opt, torch.stack(losses), torch.stack(ref_losses)


# --------------------------------------------------------------------------------------
# Rebuilding full tensors (own all-gathers)
# --------------------------------------------------------------------------------------


def owners(ctx) -> Dict[int, Tuple[object, object, object]]:
    """``id(sharded parameter) -> (unit, parameter group, fsdp parameter)``."""
    out = {}
    for unit in ctx.units:
        for group in unit.parameter_groups:
            for fp in group.fsdp_parameters:
                out[id(fp.sharded_param)] = (unit, group, fp)
    return out


def gather_rows(local: torch.Tensor, layout, index: int, shape) -> torch.Tensor:
    """The full tensor ``index`` of ``layout`` from every rank's rows (own padded all-gather
    over the world; the rows a rank holds are ``layout.local_piece``)."""
    if len(shape) == 0:
        # Replicated on every rank; the copies may differ in the last bit (reduction order),
        # so take the lowest rank's (what a checkpoint holds).
        value = local.detach().clone().reshape(())
        dist.broadcast(value, src=0)
        return value
    row_numel = math.prod(shape[1:])
    ranges = [layout.local_piece(index, r)[:2] for r in range(world())]
    max_rows = max(end - start for start, end in ranges)
    padded = torch.zeros(max(max_rows * row_numel, 1), dtype=local.dtype)
    flat = local.detach().reshape(-1)
    padded[: flat.numel()] = flat
    chunks = [torch.empty_like(padded) for _ in range(world())]
    dist.all_gather(chunks, padded)
    order = sorted(range(world()), key=lambda r: ranges[r][0])
    rows = [chunks[r][: (ranges[r][1] - ranges[r][0]) * row_numel] for r in order]
    return torch.cat(rows).reshape(shape)


def _rank_order(dt: DTensor) -> List[int]:
    """Global ranks whose local pieces, concatenated, form the full tensor.

    Shard(0) on one axis: rows in that axis's rank order. HFSDP (Shard(0), Shard(0)):
    the inner shard is split once more over the outer axis, so pieces are inner-major
    (documented in parameter_group.py)."""
    mesh = dt.device_mesh
    shard = [isinstance(p, Shard) for p in dt.placements]
    ranks = mesh.mesh
    coord = mesh.get_coordinate()
    if mesh.ndim == 1:
        return ranks.tolist() if shard[0] else [rank()]
    outer, inner = ranks.shape
    o, i = coord
    if shard == [False, True]:
        return ranks[o, :].tolist()
    if shard == [True, True]:
        return [int(ranks[oo, ii]) for ii in range(inner) for oo in range(outer)]
    if shard == [True, False]:
        return ranks[:, i].tolist()
    return [rank()]


def full_tensors(dtensors: Sequence[DTensor]) -> List[torch.Tensor]:
    """The full tensors behind sharded DTensors, from their placements alone (two
    collectives for the whole list; every rank must call it with the same list). Values
    travel as float64, exact for every supported dtype, and come back in each DTensor's dtype."""
    locals_ = [dt.to_local().detach().reshape(-1).to(torch.float64) for dt in dtensors]
    lengths = torch.tensor([t.numel() for t in locals_], dtype=torch.int64)
    all_lengths = [torch.empty_like(lengths) for _ in range(world())]
    dist.all_gather(all_lengths, lengths)
    longest = max(int(ls.sum()) for ls in all_lengths)
    flat = torch.zeros(longest, dtype=torch.float64)
    if locals_:
        mine = torch.cat(locals_)
        flat[: mine.numel()] = mine
    all_flat = [torch.empty_like(flat) for _ in range(world())]
    dist.all_gather(all_flat, flat)
    pieces = [list(torch.split(all_flat[r][: int(all_lengths[r].sum())], all_lengths[r].tolist())) for r in range(world())]
    out = []
    for j, dt in enumerate(dtensors):
        full = torch.cat([pieces[r][j] for r in _rank_order(dt)])
        out.append(full.reshape(dt.shape).to(dt.dtype))
    return out


def full_tensor(dt: DTensor) -> torch.Tensor:
    return full_tensors([dt])[0]


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------


def check(condition: bool, message: str = "") -> None:
    """Assert in lockstep: every rank raises when any rank's condition fails, so a check
    that differs between ranks cannot leave the others waiting in the next collective."""
    flag = torch.tensor([0 if condition else 1], dtype=torch.int64)
    dist.all_reduce(flag)
    if flag.item():
        raise AssertionError(message if not condition else f"(failed on another rank) {message}")


def compare_params(model, reference, *, grads=True, rtol=1e-4, atol=2e-5, ref_grad_scale=1.0):
    """Compare every sharded weight (and ``.grad``) with the reference; every rank calls it."""
    ref = dict(reference.named_parameters(remove_duplicate=False))
    named = list(model.named_parameters(remove_duplicate=False))
    with_grad = [(n, p) for n, p in named if grads and ref[n].requires_grad]
    missing = [n for n, p in with_grad if p.grad is None]
    check(not missing, f"no .grad on {missing}")
    fulls = full_tensors([p for _, p in named] + [p.grad for _, p in with_grad])
    for (name, _), full in zip(named, fulls[: len(named)]):
        torch.testing.assert_close(full, ref[name].detach().to(full.dtype), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")
    for (name, _), full_grad in zip(with_grad, fulls[len(named):]):
        expected = ref[name].grad.to(full_grad.dtype) * ref_grad_scale
        torch.testing.assert_close(full_grad, expected, rtol=rtol, atol=atol, msg=lambda m: f"{name} grad: {m}")
