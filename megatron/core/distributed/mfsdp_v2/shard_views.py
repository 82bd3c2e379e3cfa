"""Where each parameter's rows live in a group's buffers: one answer for the hooks, the
optimizer views and the checkpoint alike.

``ShardViews`` is a mixin of ``ParameterGroup``. It reads the group's layouts
(``layout``, ``outer_layout`` and ``_outer_index`` for HFSDP), its rank on each axis
(``shard_index``, ``outer_rank``, ``outer_size``), ``strategy``, ``mesh`` and the buffers
(``main_weight``, ``model_weight``, ``unsharded``, ``_packed_offsets``, ``_own_unsharded``).
It never communicates.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from .row_shard import NestedRowShard, RowShard
from .row_sharded_tensor import make_dtensor


class ShardViews:
    """Per-parameter rows and views into the group's flat buffers."""

    def _inner_rows(self, full: torch.Tensor, p) -> torch.Tensor:
        """The rows of a full tensor that this rank's inner shard holds."""
        start, end, _ = self.layout.local_piece(p.index, self.shard_index)
        if full.numel() == 0:
            return full.new_empty(self._model_view_shape(p, end - start))
        return full.reshape(self.layout.rows[p.index], -1)[start:end].reshape(self._model_view_shape(p, end - start))

    def _optimizer_rows(self, full: torch.Tensor, p) -> torch.Tensor:
        """The rows of a full tensor that this rank's optimizer shard holds."""
        if not self.strategy.optim_sharded:
            return full
        inner = self._inner_rows(full, p)
        if self.outer_layout is None:
            return inner
        j = self._outer_index.get(p.index)
        if j is None:
            return inner
        start, end, _ = self.outer_layout.local_piece(j, self.outer_rank)
        return inner[start:end] if inner.dim() > 0 else inner

    @staticmethod
    def _model_view_shape(p, rows: int):
        return (rows,) + tuple(p.shape[1:]) if len(p.shape) > 0 else (() if rows == 1 else (0,))

    def _optim_view(self, buffer: torch.Tensor, p) -> torch.Tensor:
        """Parameter ``p``'s slice of a buffer laid out like main_weight."""
        if self.outer_layout is not None:
            j = self._outer_index.get(p.index)
            if j is None:  # this inner shard holds no rows of p
                return buffer.narrow(0, 0, 0).view(self._model_view_shape(p, 0))
            view = self.outer_layout.local_view(buffer, j, self.outer_rank)
            return view.view(self._model_view_shape(p, view.shape[0] if view.dim() else 1))
        if self.strategy.optim_sharded:
            return self.layout.local_view(buffer, p.index, self.shard_index)
        return self.layout.gathered_view(buffer, p.index)  # a single shard: never split

    def _main_view(self, p) -> torch.Tensor:
        return self._optim_view(self.main_weight, p)

    def _model_view(self, p) -> torch.Tensor:
        return self.layout.local_view(self.model_weight, p.index, self.shard_index)

    def _gathered_tensor(self, gathered: torch.Tensor, p) -> torch.Tensor:
        if self.layout.is_contiguous_in_gathered(p.index):
            return self.layout.gathered_view(gathered, p.index)
        if p.index not in self._own_unsharded:
            self._own_unsharded[p.index] = torch.empty(p.shape, dtype=gathered.dtype, device=gathered.device)
        return self._own_unsharded[p.index]

    def _unsharded_tensor(self, p) -> torch.Tensor:
        if self.strategy.param_sharded or self.unsharded is self.main_weight:
            return self._gathered_tensor(self.unsharded, p)
        start = self._packed_offsets[p.index]
        return self.unsharded.narrow(0, start, self.layout.numels[p.index]).view(p.shape)

    def _dtensor(self, local: torch.Tensor, p, placements) -> DTensor:
        return make_dtensor(local, self.mesh, placements, p.shape, p.stride)

    def _optimizer_placements(self, p):
        """Placements that describe ``p``'s optimizer shard truthfully (see row_shard.py)."""
        if self.layout.replicated[p.index]:  # 0-d: a copy on every rank
            return (Replicate(),) * (1 if self.outer_group is None else 2)
        if not self.strategy.optim_sharded:
            inner = Replicate()
        elif self.outer_layout is not None:
            inner = NestedRowShard()
        else:
            inner = RowShard([end - start for start, end, _ in
                              (self.layout.local_piece(p.index, s) for s in range(self.layout.num_shards))])
        if self.outer_group is None:
            return (inner,)
        if self.outer_layout is None:
            return (Replicate(), inner)
        # HFSDP: this rank's rows and their global offset, from both levels of the layout.
        inner_start, _, _ = self.layout.local_piece(p.index, self.shard_index)
        j = self._outer_index.get(p.index)
        start, end, _ = (0, 0, 0) if j is None else self.outer_layout.local_piece(j, self.outer_rank)
        return (NestedRowShard(end - start, inner_start + start), inner)
