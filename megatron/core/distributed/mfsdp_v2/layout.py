"""Packing many tensors into one flat buffer that is split into equal per-rank shards.

The tensors of a parameter group are laid end to end in a *virtual* unsharded buffer and
cut into ``num_shards`` contiguous regions at whole dim-0 row boundaries. Every region is
padded to the same ``shard_numel`` so that all-gather and reduce-scatter see equal-sized
chunks. A rank's region therefore holds whole rows of one or more tensors, which is what
lets its slice of each tensor be a ``Shard(0)`` DTensor local view. Regions may be
uneven; a rank may own zero rows of a tensor, or nothing at all.

The gathered buffer (``num_shards * shard_numel``) is the concatenation of the regions. A
tensor whose pieces are adjacent there (it sits inside one region, or it spans regions
that are full up to the boundary) is a plain view of it; only a tensor that the padding
at the end of a region splits is assembled by a copy.

0-d tensors have no dim 0 to shard: they are *replicated*, one copy at the start of every
shard. Writing the same gradient into every copy makes a reduce-scatter hand each rank
the full reduced value, so they need no special communication.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Sequence, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``[row_start, row_end)`` of tensor ``index`` stored on ``shard`` at ``offset``
    (element offset inside that shard)."""

    index: int
    shard: int
    row_start: int
    row_end: int
    offset: int
    numel: int


class FlatLayout:
    """Row-aligned partition of a list of tensor shapes into ``num_shards`` equal shards."""

    def __init__(self, shapes: Sequence[torch.Size], num_shards: int):
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}.")
        self.shapes: List[torch.Size] = [torch.Size(s) for s in shapes]
        self.num_shards = num_shards
        # A 0-d tensor is one row of one element.
        self.replicated = [len(s) == 0 for s in self.shapes]
        self.num_replicated = sum(self.replicated)
        self.rows = [s[0] if len(s) > 0 else 1 for s in self.shapes]
        self.row_numels = [math.prod(s[1:]) if len(s) > 0 else 1 for s in self.shapes]
        self.numels = [r * w for r, w in zip(self.rows, self.row_numels)]
        self.total_numel = sum(self.numels)
        self.shard_numel = self._smallest_shard_numel()
        self.pieces: List[List[Piece]] = self._assign(self.shard_numel)
        # pieces_by_shard[s]: the pieces stored on shard s, in buffer order.
        self.pieces_by_shard: List[List[Piece]] = [[] for _ in range(num_shards)]
        for tensor_pieces in self.pieces:
            for piece in tensor_pieces:
                self.pieces_by_shard[piece.shard].append(piece)
        self._contiguous = [
            self.replicated[index] or all(
                b.shard * self.shard_numel + b.offset == a.shard * self.shard_numel + a.offset + a.numel
                for a, b in zip(tensor_pieces, tensor_pieces[1:])
            )
            for index, tensor_pieces in enumerate(self.pieces)
        ]

    # Construction ---------------------------------------------------------------------
    def _fill(self, capacity: int):
        """Greedily fill shards of ``capacity`` elements with whole rows, in order.

        Returns the list of pieces per tensor, or None when ``num_shards`` shards of that
        capacity cannot hold everything."""
        if capacity < self.num_replicated:
            return None
        # Replicated scalars first, at the same offsets in every shard.
        scalar_offset = {}
        for index in range(len(self.shapes)):
            if self.replicated[index]:
                scalar_offset[index] = len(scalar_offset)
        shard, used = 0, self.num_replicated
        pieces: List[List[Piece]] = []
        for index, (rows, width) in enumerate(zip(self.rows, self.row_numels)):
            if self.replicated[index]:
                offset = scalar_offset[index]
                pieces.append([Piece(index, s, 0, 1, offset, 1) for s in range(self.num_shards)])
                continue
            tensor_pieces: List[Piece] = []
            if rows * width == 0:  # an empty tensor occupies no room on any shard
                pieces.append(tensor_pieces)
                continue
            row = 0
            while row < rows:
                if width > capacity:
                    return None
                fit = (capacity - used) // width
                if fit == 0:
                    shard, used = shard + 1, self.num_replicated
                    if shard >= self.num_shards:
                        return None
                    continue
                take = min(fit, rows - row)
                tensor_pieces.append(Piece(index, shard, row, row + take, used, take * width))
                used += take * width
                row += take
            pieces.append(tensor_pieces)
        return pieces

    def _smallest_shard_numel(self) -> int:
        """The smallest shard size whose greedy row fill fits into ``num_shards`` shards.

        The fill wastes less than one row per shard boundary, so the answer lies in
        [ceil(total / n), ceil(total / n) + max row]; binary search it."""
        if self.total_numel == 0:
            return 0
        base = math.ceil((self.total_numel - self.num_replicated) / self.num_shards) + self.num_replicated
        # The widest row that must fit next to the replicated scalars (scalars and tensors
        # without elements need no room of their own).
        widest = max(
            (w for w, n, rep in zip(self.row_numels, self.numels, self.replicated) if n > 0 and not rep), default=0
        )
        low = max(base, widest + self.num_replicated)
        high = base + widest
        while low < high:
            mid = (low + high) // 2
            if self._fill(mid) is not None:
                high = mid
            else:
                low = mid + 1
        return low

    def _assign(self, capacity: int) -> List[List[Piece]]:
        if self.total_numel == 0:
            return [[] for _ in self.shapes]
        pieces = self._fill(capacity)
        assert pieces is not None  # guaranteed by _smallest_shard_numel
        return pieces

    # Queries --------------------------------------------------------------------------
    @property
    def gathered_numel(self) -> int:
        return self.shard_numel * self.num_shards

    def used_numel(self, shard: int) -> int:
        return sum(p.numel for p in self.pieces_by_shard[shard])

    def padding_numel(self, shard: int) -> int:
        return self.shard_numel - self.used_numel(shard)

    def local_piece(self, index: int, shard: int) -> Tuple[int, int, int]:
        """``(row_start, row_end, offset)`` of tensor ``index`` on ``shard``; an empty range
        (at the tensor's row where the shard would start) when the shard holds none of it."""
        for piece in self.pieces[index]:
            if piece.shard == shard:
                return piece.row_start, piece.row_end, piece.offset
        # Empty local shard: pick the row position consistent with shard order.
        row = 0
        for piece in self.pieces[index]:
            if piece.shard < shard:
                row = piece.row_end
        return row, row, 0

    def local_view(self, flat_shard: torch.Tensor, index: int, shard: int) -> torch.Tensor:
        """The rows of tensor ``index`` that ``shard`` holds, as a view of ``flat_shard``."""
        start, end, offset = self.local_piece(index, shard)
        shape = self.shapes[index]
        numel = (end - start) * self.row_numels[index]
        view = flat_shard.narrow(0, offset, numel)
        if len(shape) == 0:
            return view.view(()) if numel == 1 else view.view(0)
        return view.view((end - start,) + tuple(shape[1:]))

    def is_contiguous_in_gathered(self, index: int) -> bool:
        """Whether tensor ``index`` is one unbroken range of the gathered buffer (no shard
        padding between its pieces), so that it can be a view of it."""
        return self._contiguous[index]

    def gathered_view(self, gathered: torch.Tensor, index: int) -> torch.Tensor:
        """Tensor ``index`` as a view of the gathered buffer (only if it is contiguous there)."""
        if not self._contiguous[index]:
            raise ValueError("shard padding splits this tensor; assemble it with copy_out instead")
        pieces = self.pieces[index]
        shape = self.shapes[index]
        if not pieces:
            return gathered.narrow(0, 0, 0).view(shape)
        start = pieces[0].shard * self.shard_numel + pieces[0].offset
        return gathered.narrow(0, start, self.numels[index]).view(shape)

    def gathered_slices(self, gathered: torch.Tensor, index: int) -> List[torch.Tensor]:
        """The flat pieces of tensor ``index`` inside the gathered buffer, in row order
        (for a replicated tensor: its copies, one per shard)."""
        return [
            gathered.narrow(0, p.shard * self.shard_numel + p.offset, p.numel) for p in self.pieces[index]
        ]

    def copy_out(self, gathered: torch.Tensor, index: int, out: torch.Tensor) -> None:
        """Assemble tensor ``index`` from the gathered buffer into ``out`` (contiguous)."""
        flat = out.view(-1)
        position = 0
        slices = self.gathered_slices(gathered, index)
        for piece in slices[:1] if self.replicated[index] else slices:
            flat.narrow(0, position, piece.numel()).copy_(piece)
            position += piece.numel()

    def copy_in(self, source: torch.Tensor, gathered: torch.Tensor, index: int) -> None:
        """Scatter a full tensor ``index`` into its places in a gathered-layout buffer."""
        flat = source.reshape(-1)
        if self.replicated[index]:
            for piece in self.gathered_slices(gathered, index):
                piece.copy_(flat)
            return
        position = 0
        for piece in self.gathered_slices(gathered, index):
            piece.copy_(flat.narrow(0, position, piece.numel()))
            position += piece.numel()

    def source_chunks(self, source: torch.Tensor, index: int) -> List[torch.Tensor]:
        """A full tensor cut into the flat chunks that match ``gathered_slices``."""
        flat = source.reshape(-1)
        if self.replicated[index]:
            return [flat] * len(self.pieces[index])
        chunks, position = [], 0
        for piece in self.pieces[index]:
            chunks.append(flat.narrow(0, position, piece.numel))
            position += piece.numel
        return chunks
