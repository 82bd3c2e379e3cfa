"""Shared helpers for the strategy / precision tests (1, 2 or 4 gloo ranks).

Nothing here asserts. Expected values never come from the engine under test: they come
from a plain single-process reference model (a deepcopy taken before ``fully_shard``,
trained on the global batch) or from arithmetic on parameter shapes. Sharded tensors are
rebuilt into full tensors with this file's own all-gather, concatenating every rank's
local rows in mesh order, so no engine layout query is needed to compare values.

Meshes: 1-D strategies use a 1-D mesh over the world. HSDP/HFSDP use a 2-D mesh with dims
named ("outer", "inner"): 2x2 at 4 ranks, both (2, 1) and (1, 2) at 2 ranks (so both the
outer reductions and the inner sharding are exercised), (1, 1) at 1 rank.
"""

from __future__ import annotations

import copy
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from megatron.core.distributed.mfsdp_v2 import (
    Placements,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
    microbatch,
)

STRATEGIES = ["no_shard", "zero1", "zero2", "zero3", "hsdp", "hfsdp"]
HYBRID = ("hsdp", "hfsdp")
H = 8  # model input/output width
W = 12  # inner width (co-prime-ish with H so rows span shard boundaries)
ROWS_PER_RANK = 2


def world() -> int:
    return dist.get_world_size()


def rank() -> int:
    return dist.get_rank()


def hybrid_shapes() -> List[Tuple[int, int]]:
    n = world()
    if n == 1:
        return [(1, 1)]
    if n == 2:
        return [(2, 1), (1, 2)]
    if n == 4:
        return [(2, 2)]
    return [(n // 2, 2)] if n % 2 == 0 else [(n, 1)]


def strategy_cases() -> List[Tuple[str, Optional[Tuple[int, int]]]]:
    """(strategy, 2-D mesh shape or None): hybrids once per mesh shape of this world."""
    out = []
    for name in STRATEGIES:
        if name in HYBRID:
            out.extend((name, shape) for shape in hybrid_shapes())
        else:
            out.append((name, None))
    return out


def case_id(case) -> str:
    name, shape = case
    return name if shape is None else f"{name}-{shape[0]}x{shape[1]}"


_MESHES: Dict[Tuple, object] = {}


def mesh_1d():
    key = (world(),)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", key)
    return _MESHES[key]


def mesh_2d(shape: Tuple[int, int]):
    key = tuple(shape)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", key, mesh_dim_names=("outer", "inner"))
    return _MESHES[key]


def setup(case):
    """(mesh, placements) for a strategy case; hybrids name their axes by mesh dim name."""
    name, shape = case
    if name in HYBRID:
        return mesh_2d(shape), getattr(Placements, name)("outer", "inner")
    return mesh_1d(), getattr(Placements, name)()


def sizes(case) -> Tuple[int, int]:
    """(outer size M, inner size N) of a case's mesh; M = 1 for 1-D strategies."""
    name, shape = case
    if shape is None:
        return 1, world()
    return shape


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, w: int = W):
        super().__init__()
        self.lin = nn.Linear(w, w)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    """Units blocks[0], blocks[1] and the root (which owns ``inp`` and ``head``)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(H, W)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(W, H)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def units(self):
        return [self.blocks[0], self.blocks[1], self]

    # Parameter counts of each unit (what the layouts must hold), from the shapes alone.
    @staticmethod
    def unit_shapes():
        lin = [torch.Size((W, W)), torch.Size((W,))]
        root = [torch.Size((W, H)), torch.Size((W,)), torch.Size((H, W)), torch.Size((H,))]
        return [lin, lin, root]


def wrap(model: nn.Module, case, units=None, *, policy=None, grad_divisor=1, cast=None):
    """fully_shard every unit of ``model`` (children first) in one scope.

    ``cast``: a dtype the model is moved to inside the scope, before any unit is built."""
    mesh, placements = setup(case)
    kwargs = {}
    if policy is not None:
        kwargs["mixed_precision_policy"] = policy
    if grad_divisor != 1:
        kwargs["grad_divisor"] = grad_divisor
    with fully_shard_context(device="cpu") as ctx:
        if cast is not None:
            model.to(cast)
        for unit in units if units is not None else model.units():
            fully_shard(unit, mesh=mesh, placements=placements, **kwargs)
    return ctx


def build_pair(case, *, seed=0, model_cls=Net, **wrap_kwargs):
    torch.manual_seed(seed)
    model = model_cls()
    reference = copy.deepcopy(model)
    ctx = wrap(model, case, **wrap_kwargs)
    return model, reference, ctx


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)
    raise ValueError(kind)


def local_rows(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[0] // world()
    return t[rank() * n : (rank() + 1) * n]


def global_mean(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().clone().float()
    dist.all_reduce(value)
    return value / world()


def batches(generator, microbatches: int, in_features: int = H, out_features: int = H):
    rows = ROWS_PER_RANK * world()
    return [
        (torch.randn(rows, in_features, generator=generator), torch.randn(rows, out_features, generator=generator))
        for _ in range(microbatches)
    ]


def train_pair(case, optimizer: str, microbatches: int, steps: int, *, set_to_none=True, seed=0, **build_kwargs):
    """Train the wrapped model and its reference side by side; returns
    (model, reference, ctx, opt, losses, ref_losses)."""
    model, reference, ctx = build_pair(case, seed=seed, **build_kwargs)
    opt = fully_shard_optimizer(make_optimizer(optimizer, model.parameters()))
    ref_opt = make_optimizer(optimizer, reference.parameters())
    generator = torch.Generator().manual_seed(seed + 1)
    losses, ref_losses = [], []
    for _ in range(steps):
        mbs = batches(generator, microbatches)
        ref_opt.zero_grad(set_to_none=set_to_none)
        x = torch.cat([b[0] for b in mbs])
        y = torch.cat([b[1] for b in mbs])
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(ref_loss.detach())
        opt.zero_grad(set_to_none=set_to_none)
        total = torch.zeros(())
        for i, (xb, yb) in enumerate(mbs):
            with microbatch(ctx, is_last=i == microbatches - 1):
                loss = F.mse_loss(model(local_rows(xb)), local_rows(yb)) / microbatches
                loss.backward()
            total += loss.detach().float()
        opt.step()
        losses.append(global_mean(total))
    return model, reference, ctx, opt, torch.stack(losses), torch.stack(ref_losses)


# --------------------------------------------------------------------------------------
# Rebuilding full tensors from shards (own all-gather; no engine layout queries)
# --------------------------------------------------------------------------------------


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
    """The full tensors behind sharded DTensors (two collectives for the whole list; every
    rank must call it with the same list). Values travel as float64, exact for every
    supported dtype, and come back in each DTensor's dtype."""
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


def check(condition: bool, message: str = "") -> None:
    """Assert in lockstep: every rank raises when any rank's condition fails, so a check
    that differs between ranks cannot leave the others waiting in the next collective."""
    flag = torch.tensor([0 if condition else 1], dtype=torch.int64)
    dist.all_reduce(flag)
    if flag.item():
        raise AssertionError(message if not condition else f"(failed on another rank) {message}")


def groups_of(ctx):
    """[(unit, group)] in unit registration order."""
    return [(unit, g) for unit in ctx.units for g in unit.parameter_groups]


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def numel(shapes: Sequence[torch.Size]) -> int:
    return sum(math.prod(s) for s in shapes)


class DistTap:
    """Counts the collectives called on ``torch.distributed`` while active, independently
    of the engine's own counter: a collective issued around the work wrapper is seen too.

    Records ``(kind, bytes a rank contributes, group size)`` like the engine's counter;
    a collective that calls another one internally counts once."""

    KINDS = {
        "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
        "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
        "all_reduce": "all_reduce",
    }

    def __init__(self):
        self.records: List[Tuple[str, int, int]] = []
        self._originals = {}
        self._depth = 0

    def _wrap(self, name: str, fn):
        kind = self.KINDS[name]

        def tapped(*args, **kwargs):
            if self._depth == 0:
                tensor = args[0] if kind == "all_reduce" else (args[1] if len(args) > 1 else kwargs["input"])
                group = kwargs.get("group", args[3 if kind == "reduce_scatter" else 2] if len(args) > 3 else None)
                self.records.append((kind, tensor.numel() * tensor.element_size(), dist.get_world_size(group)))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return tapped

    def __enter__(self) -> "DistTap":
        for name in self.KINDS:
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._originals[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()
