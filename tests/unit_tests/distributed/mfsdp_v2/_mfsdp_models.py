"""Toy models and comparison helpers for the MFSDP v2 distributed tests.

Every helper works in a world of 1, 2 or 4 gloo ranks. Nothing here asserts: the tests do.
The expected values these helpers produce never come from the engine under test: they come
from a plain single-process reference model (same init: it is a deepcopy taken before
``fully_shard``) or from arithmetic on the original tensors. The only engine facts used
are the row ranges a rank holds (``layout.local_piece``), which the layout tests check
independently.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from megatron.core.distributed.mfsdp_v2 import (
    Placements,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
    microbatch,
)

H = 8  # hidden size of every toy model
VOCAB = 12
ROWS_PER_RANK = 2  # rows of one microbatch each rank sees

_MESH = None


def world() -> int:
    return dist.get_world_size()


def rank() -> int:
    return dist.get_rank()


def mesh():
    """The 1-D data-parallel mesh over the whole world (built once)."""
    global _MESH
    if _MESH is None:
        _MESH = init_device_mesh("cpu", (world(),))
    return _MESH


def zero3() -> Placements:
    return Placements.zero3()


def wrap(model: nn.Module, units: Sequence[nn.Module], **context_kwargs):
    """``fully_shard`` every module of ``units`` (in the given order) in one scope."""
    with fully_shard_context(device="cpu", **context_kwargs) as ctx:
        for unit in units:
            fully_shard(unit, mesh=mesh(), placements=zero3())
    return ctx


# --------------------------------------------------------------------------------------
# Toy modules
# --------------------------------------------------------------------------------------


class Block(nn.Module):
    """tanh(Linear(x)), optionally followed by a nested ``inner`` block."""

    def __init__(self, h: int = H, inner: bool = False, spare: bool = False):
        super().__init__()
        self.lin = nn.Linear(h, h)
        self.inner = Block(h) if inner else None
        # A trainable parameter the forward never uses (an unused branch inside a unit).
        self.spare = nn.Linear(h, h) if spare else None

    def forward(self, x):
        x = torch.tanh(self.lin(x))
        if self.inner is not None:
            x = self.inner(x)
        return x


class Nested(nn.Module):
    """Units m, m.left, m.left.inner, m.right; the root owns ``head``."""

    def __init__(self):
        super().__init__()
        self.left = Block(inner=True)
        self.right = Block()
        self.head = nn.Linear(H, H)

    def forward(self, x):
        return self.head(self.right(self.left(x)))

    def units(self):
        return [self.left.inner, self.left, self.right, self]


class Siblings(nn.Module):
    """Two sibling roots (``a`` and ``b`` with ``b.inner``); the parent is no unit and owns nothing."""

    def __init__(self):
        super().__init__()
        self.a = Block()
        self.b = Block(inner=True)

    def forward(self, x):
        return self.b(self.a(x))

    def units(self):
        return [self.a, self.b.inner, self.b]


class ParameterlessParent(nn.Module):
    """A root unit without parameters of its own over two block units."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def units(self):
        return [self.blocks[0], self.blocks[1], self]


class Frozen(nn.Module):
    """``frozen`` is a unit of frozen parameters only (between two trainable units, so the
    backward must go through it); ``mixed`` has a trainable weight and a frozen bias."""

    def __init__(self):
        super().__init__()
        self.mixed = Block()
        self.frozen = Block()
        self.head = nn.Linear(H, H)
        self.mixed.lin.bias.requires_grad_(False)
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.head(self.frozen(self.mixed(x)))

    def units(self):
        return [self.mixed, self.frozen, self]


class Tied(nn.Module):
    """Embedding and output projection share one weight; both live in the root unit."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        self.mid = Block()
        self.out = nn.Linear(H, VOCAB, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(self.mid(self.emb(idx)))

    def units(self):
        return [self.mid, self]


class Checkpointed(nn.Module):
    """Units run under torch.utils.checkpoint; ``blocks[1]`` holds a nested unit."""

    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.pre = nn.Linear(H, H)  # makes the checkpointed inputs require grad (reentrant needs it)
        self.blocks = nn.ModuleList([Block(), Block(inner=True)])
        self.head = nn.Linear(H, H)

    def forward(self, x):
        x = self.pre(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x)

    def units(self):
        return [self.blocks[0], self.blocks[1].inner, self.blocks[1], self]


class _TwoSegments(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(H, H)
        self.shared = nn.Linear(H, H)

    def _segment(self, x):
        return torch.tanh(self.shared(x))

    def forward(self, x):
        x = self.first(x)
        for _ in range(2):
            x = checkpoint(self._segment, x, use_reentrant=True)
        return x


class SharedAcrossSegments(nn.Module):
    """One unit runs the same layer in two reentrant checkpoint segments. Each segment's
    backward is its own autograd graph, so ``shared``'s gradient arrives twice in one
    backward, both times before ``first``'s (the unit is reduced only after that)."""

    def __init__(self):
        super().__init__()
        self.unit = _TwoSegments()
        self.head = nn.Linear(H, H)

    def forward(self, x):
        return self.head(self.unit(x))

    def units(self):
        return [self.unit, self]


class UnusedBranch(nn.Module):
    """``unused`` is a unit the forward never calls; ``b.spare`` is an unused parameter
    inside a unit whose other parameters do get gradients."""

    def __init__(self):
        super().__init__()
        self.a = Block()
        self.unused = Block()
        self.b = Block(spare=True)
        self.head = nn.Linear(H, H)

    def forward(self, x):
        return self.head(self.b(self.a(x)))

    def units(self):
        return [self.a, self.unused, self.b, self]


class ScaledBlock(Block):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return super().forward(x) * self.scale


class Scaled(nn.Module):
    """A unit holding a 0-d parameter (replicated on every rank) next to sharded ones."""

    def __init__(self):
        super().__init__()
        self.block = ScaledBlock()
        self.head = nn.Linear(H, H)

    def forward(self, x):
        return self.head(self.block(x))

    def units(self):
        return [self.block, self]


class Tiny(nn.Module):
    """Three elements in all: at 4 ranks some rank must own no rows."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def forward(self, x):
        return self.lin(x)

    def units(self):
        return [self]


# --------------------------------------------------------------------------------------
# Cases for the reference comparison
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    tokens: bool = False  # inputs are token ids (cross-entropy loss) instead of features
    in_features: int = H
    out_features: int = H

    def batch(self, generator: torch.Generator, rows: int):
        if self.tokens:
            x = torch.randint(0, VOCAB, (rows, 3), generator=generator)
            y = torch.randint(0, VOCAB, (rows, 3), generator=generator)
        else:
            x = torch.randn(rows, self.in_features, generator=generator)
            y = torch.randn(rows, self.out_features, generator=generator)
        return x, y

    def loss(self, model: nn.Module, x, y):
        out = model(x)
        if self.tokens:
            return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
        return F.mse_loss(out, y)


CASES: Dict[str, Case] = {
    "nested": Case("nested", Nested),
    "sibling_roots": Case("sibling_roots", Siblings),
    "parameterless_parent": Case("parameterless_parent", ParameterlessParent),
    "frozen": Case("frozen", Frozen),
    "tied": Case("tied", Tied, tokens=True),
    "checkpoint_reentrant": Case("checkpoint_reentrant", lambda: Checkpointed(True)),
    "checkpoint_nonreentrant": Case("checkpoint_nonreentrant", lambda: Checkpointed(False)),
    "shared_across_reentrant_segments": Case("shared_across_reentrant_segments", SharedAcrossSegments),
    "unused_branch": Case("unused_branch", UnusedBranch),
    "tiny": Case("tiny", Tiny, in_features=2, out_features=1),
    "scalar_parameter": Case("scalar_parameter", Scaled),
}


def build_pair(case: Case, seed: int = 0):
    """(model, reference, context): the reference is a deepcopy taken before wrapping."""
    torch.manual_seed(seed)
    model = case.build()
    reference = copy.deepcopy(model)
    ctx = wrap(model, model.units())
    return model, reference, ctx


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)
    raise ValueError(kind)


def local_rows(tensor: torch.Tensor) -> slice:
    """This rank's rows of a global batch (equal slices)."""
    n = tensor.shape[0] // world()
    return tensor[rank() * n : (rank() + 1) * n]


def global_mean(value: torch.Tensor) -> torch.Tensor:
    """All-reduce SUM then divide: the mean over ranks of a scalar."""
    value = value.detach().clone().float()
    dist.all_reduce(value)
    return value / world()


def zero_missing_grads(model: nn.Module) -> None:
    """The engine's contract for unused trainable parameters: their gradient is zero, not None."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def train_pair(case: Case, optimizer: str, microbatches: int, steps: int = 5, seed: int = 0):
    """Train the wrapped model and the reference side by side.

    Returns (model, reference, ctx, losses, ref_losses)."""
    model, reference, ctx = build_pair(case, seed)
    opt = fully_shard_optimizer(make_optimizer(optimizer, model.parameters()))
    ref_opt = make_optimizer(optimizer, reference.parameters())
    generator = torch.Generator().manual_seed(seed + 1)  # same batches on every rank
    losses, ref_losses = [], []
    for _ in range(steps):
        batches = [case.batch(generator, ROWS_PER_RANK * world()) for _ in range(microbatches)]
        # Reference: the whole global batch at once.
        ref_opt.zero_grad(set_to_none=True)
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        ref_loss = case.loss(reference, x, y)
        ref_loss.backward()
        zero_missing_grads(reference)
        ref_opt.step()
        ref_losses.append(ref_loss.detach())
        # Sharded: this rank's slice of every microbatch.
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for i, (xb, yb) in enumerate(batches):
            with microbatch(ctx, is_last=i == microbatches - 1):
                loss = case.loss(model, local_rows(xb), local_rows(yb)) / microbatches
                loss.backward()
            total += loss.detach()
        opt.step()
        losses.append(global_mean(total))
    return model, reference, ctx, torch.stack(losses), torch.stack(ref_losses)


# --------------------------------------------------------------------------------------
# Looking at shards
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class ShardInfo:
    name: str
    param: torch.nn.Parameter  # the sharded DTensor parameter
    unit: nn.Module
    group: object
    fsdp_param: object
    row_start: int
    row_end: int
    offset: int


def num_rows(shape) -> int:
    return shape[0] if len(shape) > 0 else 1


def shard_infos(model: nn.Module, ctx) -> List[ShardInfo]:
    """One entry per name of ``model.named_parameters(remove_duplicate=False)``."""
    owner = {}
    for unit in ctx.units:
        for group in unit.parameter_groups:
            for fp in group.fsdp_parameters:
                owner[id(fp.sharded_param)] = (unit, group, fp)
    infos = []
    for name, param in model.named_parameters(remove_duplicate=False):
        unit, group, fp = owner[id(param)]
        start, end, offset = group.layout.local_piece(fp.index, rank())
        infos.append(ShardInfo(name, param, unit, group, fp, start, end, offset))
    return infos


def expected_local(full: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """This rank's rows of a full (reference) tensor."""
    rows = full.detach().reshape(num_rows(full.shape), -1)[info.row_start : info.row_end]
    return rows.reshape(info.param.to_local().shape)


def gather_full(local: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """Rebuild the full tensor from every rank's local rows (own all-gather, padded)."""
    layout = info.group.layout
    index = info.fsdp_param.index
    shape = info.fsdp_param.shape
    row_numel = int(torch.Size(shape[1:]).numel()) if len(shape) > 0 else 1
    ranges = [layout.local_piece(index, r)[:2] for r in range(world())]
    max_rows = max(end - start for start, end in ranges)
    padded = torch.zeros(max_rows * row_numel, dtype=local.dtype)
    flat = local.detach().reshape(-1)
    padded[: flat.numel()] = flat
    chunks = [torch.empty_like(padded) for _ in range(world())]
    dist.all_gather(chunks, padded)
    rows = [chunk[: (end - start) * row_numel] for chunk, (start, end) in zip(chunks, ranges)]
    return torch.cat(rows).reshape(shape)


def storage_size(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().size()


def is_view_of(local: torch.Tensor, flat: torch.Tensor, element_offset: int) -> bool:
    """``local`` lies in ``flat``'s storage, starting at ``element_offset`` elements."""
    same_storage = local.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    expected_ptr = flat.data_ptr() + element_offset * flat.element_size()
    return same_storage and (local.numel() == 0 or local.data_ptr() == expected_ptr)


def is_sharded_dtensor(param) -> bool:
    from torch.distributed.tensor import Shard

    return isinstance(param, DTensor) and tuple(param.placements) == (Shard(0),)
