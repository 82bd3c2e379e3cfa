"""A matrix's whole value from the rows a data-parallel rank holds, and back.

Under MFSDP a parameter (its main weight, ``.grad`` and optimizer state) is a DTensor over
the data-parallel mesh whose local part is a contiguous range of dim-0 rows: a plain
``Shard(0)`` where the rows are torch's even split, an engine ``RowShard`` with every
rank's row count where not, ``Replicate`` on the axes that do not shard it (ZeRO-0, the
outer axis of HSDP). An optimizer that needs the whole matrix (Muon orthogonalizes it)
gathers the rows over the one sharded axis and keeps its own rows of the result.
HFSDP's optimizer rows are split over both axes (``NestedRowShard``: an outer split of each
inner shard, this rank's global offset on the outer placement): their pieces are gathered
axis by axis with their offsets (exchanged once, then cached) and placed by offset.

A plain tensor (DDP, one rank) is its own whole matrix.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - the pinned torch has it
    DTensor = None


class RowLayout:
    """Where every rank of the sharding axis keeps its rows of a ``[rows, ...]`` tensor."""

    def __init__(self, tensor: torch.Tensor):
        self.group: Optional[dist.ProcessGroup] = None
        self.counts: List[int] = []
        self.starts: List[int] = []
        self.rank = 0
        self.nested: Optional["NestedPieces"] = None
        if DTensor is None or not isinstance(tensor, DTensor):
            return
        sharded = [(d, p) for d, p in enumerate(tensor.placements) if p.is_shard()]
        if not sharded:
            return
        mesh = tensor.device_mesh
        nested = [p for _, p in sharded if type(p).__name__ == "NestedRowShard" and p.rows is not None]
        if nested:
            self.nested = NestedPieces(tensor.shape[0], nested[0].offset, nested[0].rows,
                                       [mesh.get_group(d) for d, _ in sharded])
            self.group = self.nested.groups[0]
            return
        if len(sharded) > 1:
            raise NotImplementedError("a parameter row-sharded over two mesh axes without HFSDP's nesting; "
                                      "this optimizer cannot gather it.")
        dim, placement = sharded[0]
        if placement.dim != 0:
            raise NotImplementedError(f"a parameter sharded on dim {placement.dim}; only dim-0 row shards are gathered.")
        size, total = mesh.size(dim), tensor.shape[0]
        pieces = [placement.local_shard_size_and_offset(total, size, r) for r in range(size)]
        self.group = mesh.get_group(dim)
        self.counts = [int(count) for count, _ in pieces]
        self.starts = [int(start) for _, start in pieces]
        self.rank = mesh.get_local_rank(dim)

    @property
    def sharded(self) -> bool:
        return self.group is not None

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every rank's ``local`` rows (each padded to the widest)."""
        if not self.sharded:
            return local
        if self.nested is not None:
            return self.nested.gather(local)
        widest = max(self.counts)
        padded = local.new_zeros((widest,) + tuple(local.shape[1:]))
        padded[: local.shape[0]] = local
        pieces = [torch.empty_like(padded) for _ in self.counts]
        dist.all_gather(pieces, padded, group=self.group)
        ordered = sorted(range(len(self.counts)), key=lambda r: self.starts[r])
        return torch.cat([pieces[r][: self.counts[r]] for r in ordered])

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``whole``."""
        if not self.sharded:
            return whole
        if self.nested is not None:
            return whole.narrow(0, self.nested.start, self.nested.count)
        return whole.narrow(0, self.starts[self.rank], self.counts[self.rank])


class NestedPieces:
    """Rows split over several mesh axes, each rank's piece at a global offset: gathered
    axis by axis, every piece with its (offset, rows), then placed by offset."""

    def __init__(self, total: int, start: int, count: int, groups):
        self.total, self.start, self.count, self.groups = total, int(start), int(count), groups
        self._layouts: List[List[List[Tuple[int, int]]]] = []  # per axis: per rank, its pieces

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        pieces = [(self.start, local)]
        for axis, group in enumerate(self.groups):
            if len(self._layouts) <= axis:  # the layout is static: exchanged on the first call only
                mine = torch.tensor([[s, t.shape[0]] for s, t in pieces], dtype=torch.int64, device=local.device)
                metas = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
                dist.all_gather(metas, mine, group=group)
                self._layouts.append([[tuple(row) for row in meta.tolist()] for meta in metas])
            layout = self._layouts[axis]
            widest = max(sum(n for _, n in rank_pieces) for rank_pieces in layout)
            data = torch.cat([t for _, t in pieces])
            padded = data.new_zeros((widest,) + tuple(local.shape[1:]))
            padded[: data.shape[0]] = data
            gathered = [torch.empty_like(padded) for _ in layout]
            dist.all_gather(gathered, padded, group=group)
            pieces = []
            for rank_pieces, rank_data in zip(layout, gathered):
                cursor = 0
                for start, rows in rank_pieces:
                    pieces.append((start, rank_data[cursor: cursor + rows]))
                    cursor += rows
        whole = local.new_zeros((self.total,) + tuple(local.shape[1:]))
        for start, piece in pieces:
            whole[start: start + piece.shape[0]] = piece
        return whole


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The local storage of a DTensor (live: in-place updates reach it), or the tensor."""
    return tensor.to_local() if DTensor is not None and isinstance(tensor, DTensor) else tensor


def gather_along(x: torch.Tensor, dim: int, group) -> Tuple[torch.Tensor, int, int]:
    """``x`` concatenated along ``dim`` over ``group`` (equal pieces, in rank order), with
    this rank's (start, size) in the result, to cut it back after."""
    size = dist.get_world_size(group)
    pieces = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return torch.cat(pieces, dim=dim), dist.get_rank(group) * x.shape[dim], x.shape[dim]
