"""Where each parameter's rows live in a group's buffers: one answer for the hooks, the
optimizer views and the checkpoint alike.

``ShardViews`` is built from what it needs, passed explicitly: the group's ``FlatLayout``
and this rank's shard of it, the HFSDP split of that shard (``OuterSplit``), the strategy,
the mesh and the buffers. It owns the storage of the tensors that the shard padding splits
in the gathered buffer. It never communicates.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor, Replicate

from .group_buffers import GroupBuffers
from .layout import FlatLayout
from .row_shard import NestedRowShard, RowShard
from .row_sharded_tensor import make_dtensor


@dataclasses.dataclass(frozen=True)
class OuterSplit:
    """HFSDP: this rank's inner shard split once more over the outer axis, with the same
    row-aligned layout applied to the pieces that the inner shard holds."""

    layout: FlatLayout  # over the pieces of this rank's inner shard
    index: Dict[int, int]  # parameter index -> position of its piece in the inner shard
    rank: int  # this rank on the outer axis

    @classmethod
    def of(cls, inner: FlatLayout, shard_index: int, outer_size: int, outer_rank: int) -> "OuterSplit":
        local_pieces = inner.pieces_by_shard[shard_index]
        layout = FlatLayout([
            torch.Size(()) if inner.replicated[pc.index]
            else torch.Size((pc.row_end - pc.row_start,) + tuple(inner.shapes[pc.index][1:]))
            for pc in local_pieces
        ], outer_size)
        return cls(layout, {piece.index: j for j, piece in enumerate(local_pieces)}, outer_rank)

    def piece(self, index: int) -> Optional[Tuple[int, int, int]]:
        """This rank's piece of parameter ``index`` within its inner shard's rows (as
        ``FlatLayout.local_piece``), or None: the inner shard holds no rows of it."""
        j = self.index.get(index)
        return None if j is None else self.layout.local_piece(j, self.rank)


class ShardViews:
    """Per-parameter rows and views into a group's flat buffers.

    Owns: ``_own_unsharded`` (index -> contiguous storage of a tensor that the shard padding
    splits in the gathered buffer) and the packed offsets of the replicated compute buffer.
    Reads, never changes: the layouts, ranks, strategy, mesh and the buffers' tensors."""

    def __init__(self, layout: FlatLayout, shard_index: int, outer: Optional[OuterSplit], strategy, mesh,
                 buffers: GroupBuffers, two_axes: bool):
        self.layout, self.shard_index, self.outer = layout, shard_index, outer
        self.strategy, self.mesh, self.two_axes = strategy, mesh, two_axes
        self.main_weight, self.model_weight, self.unsharded = buffers.main_weight, buffers.model_weight, buffers.unsharded
        # The unsharded compute weights are the gathered buffer (padding between shards)
        # or a packed one (tensors end to end).
        self._gathered = strategy.param_sharded or self.unsharded is self.main_weight
        self._packed_offsets = [0]
        for numel in layout.numels:
            self._packed_offsets.append(self._packed_offsets[-1] + numel)
        self._own_unsharded: Dict[int, torch.Tensor] = {
            index: torch.empty(shape, dtype=self.unsharded.dtype, device=self.unsharded.device)
            for index, shape in enumerate(layout.shapes)
            if self._gathered and not layout.is_contiguous_in_gathered(index)
        }

    # Rows of a full tensor --------------------------------------------------------------
    def inner_rows(self, full: torch.Tensor, p) -> torch.Tensor:
        """The rows of a full tensor that this rank's inner shard holds."""
        start, end, _ = self.layout.local_piece(p.index, self.shard_index)
        if full.numel() == 0:
            return full.new_empty(self._model_view_shape(p, end - start))
        return full.reshape(self.layout.rows[p.index], -1)[start:end].reshape(self._model_view_shape(p, end - start))

    def optimizer_rows(self, full: torch.Tensor, p) -> torch.Tensor:
        """The rows of a full tensor that this rank's optimizer shard holds."""
        if not self.strategy.optim_sharded:
            return full
        inner = self.inner_rows(full, p)
        if self.outer is None or p.index not in self.outer.index:
            return inner
        start, end, _ = self.outer.piece(p.index)
        return inner[start:end] if inner.dim() > 0 else inner

    def optimizer_row_range(self, p) -> Tuple[int, int]:
        """Global dim-0 rows of ``p`` held in this rank's optimizer placement (main_weight)."""
        if len(p.shape) == 0:
            return 0, 1
        if not self.strategy.optim_sharded:
            return 0, p.shape[0]
        start, end, _ = self.layout.local_piece(p.index, self.shard_index)
        if self.outer is None:
            return start, end
        piece = self.outer.piece(p.index)
        if piece is None:
            return start, start
        return start + piece[0], start + piece[1]

    def write_rows(self, p, full: torch.Tensor, unsharded: bool) -> None:
        """Copy this rank's rows of a full tensor into the main weight and the compute
        copies (the replicated compute weights too where ``unsharded``)."""
        self.main_view(p).copy_(self.optimizer_rows(full, p))
        if self.model_weight is not None and self.model_weight is not self.main_weight:
            self.model_view(p).copy_(self.inner_rows(full, p))
        if unsharded and not self.strategy.param_sharded and self.unsharded is not self.main_weight:
            self.unsharded_tensor(p).copy_(full)

    # Views into the buffers ----------------------------------------------------------------
    @staticmethod
    def _model_view_shape(p, rows: int):
        return (rows,) + tuple(p.shape[1:]) if len(p.shape) > 0 else (() if rows == 1 else (0,))

    def optim_view(self, buffer: torch.Tensor, p) -> torch.Tensor:
        """Parameter ``p``'s slice of a buffer laid out like main_weight."""
        if self.outer is not None:
            j = self.outer.index.get(p.index)
            if j is None:  # this inner shard holds no rows of p
                return buffer.narrow(0, 0, 0).view(self._model_view_shape(p, 0))
            view = self.outer.layout.local_view(buffer, j, self.outer.rank)
            return view.view(self._model_view_shape(p, view.shape[0] if view.dim() else 1))
        if self.strategy.optim_sharded:
            return self.layout.local_view(buffer, p.index, self.shard_index)
        return self.layout.gathered_view(buffer, p.index)  # a single shard: never split

    def main_view(self, p) -> torch.Tensor:
        return self.optim_view(self.main_weight, p)

    def model_view(self, p) -> torch.Tensor:
        return self.layout.local_view(self.model_weight, p.index, self.shard_index)

    def unsharded_tensor(self, p) -> torch.Tensor:
        """``p``'s full compute tensor: a view of the unsharded buffer, or its own storage."""
        if not self._gathered:
            start = self._packed_offsets[p.index]
            return self.unsharded.narrow(0, start, self.layout.numels[p.index]).view(p.shape)
        if p.index in self._own_unsharded:
            return self._own_unsharded[p.index]
        return self.layout.gathered_view(self.unsharded, p.index)

    def unsharded_storages(self) -> Tuple[torch.Tensor, ...]:
        """The tensors whose storage an unshard fills and a reshard frees."""
        return (self.unsharded,) + tuple(self._own_unsharded.values())

    def gather_post_ops(self) -> list:
        """What the all-gather into ``unsharded`` must run once it is done: assemble the
        tensors that the shard padding splits (none: nothing to run)."""
        return [self._copy_out_spanning] if self._own_unsharded else []

    def _copy_out_spanning(self) -> None:
        for index, tensor in self._own_unsharded.items():
            self.layout.copy_out(self.unsharded, index, tensor)

    # DTensors ----------------------------------------------------------------------------
    def dtensor(self, local: torch.Tensor, p, placements) -> DTensor:
        return make_dtensor(local, self.mesh, placements, p.shape, p.stride)

    def optimizer_placements(self, p):
        """Placements that describe ``p``'s optimizer shard truthfully (see row_shard.py)."""
        if self.layout.replicated[p.index]:  # 0-d: a copy on every rank
            return (Replicate(),) * (2 if self.two_axes else 1)
        if not self.strategy.optim_sharded:
            inner = Replicate()
        elif self.outer is not None:
            inner = NestedRowShard()
        else:
            inner = RowShard([end - start for start, end, _ in
                              (self.layout.local_piece(p.index, s) for s in range(self.layout.num_shards))])
        if not self.two_axes:
            return (inner,)
        if self.outer is None:
            return (Replicate(), inner)
        # HFSDP: this rank's rows and their global offset, from both levels of the layout.
        inner_start, _, _ = self.layout.local_piece(p.index, self.shard_index)
        start, end, _ = self.outer.piece(p.index) or (0, 0, 0)
        return (NestedRowShard(end - start, inner_start + start), inner)
