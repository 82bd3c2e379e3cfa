"""Toy models, their case table and shard lookups for the MFSDP v2 distributed tests.

Every helper works in a world of 1, 2 or 4 gloo ranks. Nothing here asserts: the tests do.
Meshes, wrapping, reference training and all-gathers are the shared ``_dist_helpers``.
The expected values these helpers produce never come from the engine under test: they come
from a plain single-process reference model (same init: it is a deepcopy taken before
``fully_shard``) or from arithmetic on the original tensors. The only engine facts used
are the row ranges a rank holds (``layout.local_piece``), which the layout tests check
independently.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

from _dist_helpers import H, feature_batch, gather_rows, mse, owners, rank, train_pair

VOCAB = 12


# --------------------------------------------------------------------------------------
# Toy modules
# --------------------------------------------------------------------------------------


class BlocksAroundProjection(nn.Module):
    """``proj``, then each block (its own unit), then ``proj`` again (one root weight used
    twice). The blocks and ``proj`` are the caller's."""

    def __init__(self, blocks, proj: nn.Module):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.proj = proj

    def units(self):
        return [*self.blocks, self]

    def forward(self, x):
        h = self.proj(x)
        for block in self.blocks:
            h = block(h)
        return self.proj(torch.tanh(h))


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
        if not self.tokens:
            return feature_batch(generator, rows, self.in_features, self.out_features)
        x = torch.randint(0, VOCAB, (rows, 3), generator=generator)
        y = torch.randint(0, VOCAB, (rows, 3), generator=generator)
        return x, y

    def loss(self, model: nn.Module, x, y):
        if not self.tokens:
            return mse(model, x, y)
        return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


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


def train_case(case: Case, optimizer: str, microbatches: int, steps: int, seed: int = 0):
    """``train_pair`` on a case's model, batches and loss; returns its six values."""
    return train_pair(case.build, optimizer, microbatches, steps, batch=case.batch, loss=case.loss, seed=seed)


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
    owner = owners(ctx)
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
    return gather_rows(local, info.group.layout, info.fsdp_param.index, info.fsdp_param.shape)


def storage_size(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().size()


def is_view_of(local: torch.Tensor, flat: torch.Tensor, element_offset: int) -> bool:
    """``local`` lies in ``flat``'s storage, starting at ``element_offset`` elements."""
    same_storage = local.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    expected_ptr = flat.data_ptr() + element_offset * flat.element_size()
    return same_storage and (local.numel() == 0 or local.data_ptr() == expected_ptr)


def is_sharded_dtensor(param) -> bool:
    # A dim-0 shard of any row split: MFSDP v2's RowShard equals Shard(0) only for torch's even one.
    return isinstance(param, DTensor) and len(param.placements) == 1 and isinstance(param.placements[0], Shard) \
        and param.placements[0].dim == 0
