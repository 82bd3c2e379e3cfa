"""``RowShard``: the DTensor placement that tells the truth about the engine's shards.

The engine cuts a parameter group into per-rank regions at whole dim-0 rows (see
``layout.py``), so rank ``r`` holds ``rows[r]`` rows of a tensor, starting at row
``sum(rows[:r])``. Those counts are usually not torch's even ``torch.chunk`` split that a
plain ``Shard(0)`` implies, and DTensor would gather, scatter and offset them wrongly.

``RowShard(rows)`` is a ``Shard(0)`` whose collectives use the true row counts:
``full_tensor()``, ``redistribute()`` to and from ``Replicate``/``Partial``, and the local
shape and global offset that ``torch.distributed.checkpoint`` reads. Operators on a DTensor
with uneven rows are guarded by its class, ``RowShardedTensor`` (row_sharded_tensor.py):
their results keep the row counts or raise, so optimizer state is honest too.

``NestedRowShard`` marks the outer axis of HFSDP's optimizer shards, which split an inner
row shard once more: DTensor's left-to-right shard order cannot describe that nesting, so
every redistribution through it raises instead of returning wrong values.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import Shard

from megatron.core.torch_private import functional_collectives as funcol


class RowShard(Shard):
    """Dim-0 sharding with ``rows[r]`` rows on mesh coordinate ``r`` (in order)."""

    def __init__(self, rows: Sequence[int]):
        super().__init__(0)
        self.rows: Tuple[int, ...] = tuple(int(r) for r in rows)
        self.starts: Tuple[int, ...] = tuple(sum(self.rows[:i]) for i in range(len(self.rows)))
        total, n = sum(self.rows), len(self.rows)
        self._even = all(Shard(0).local_shard_size_and_offset(total, n, r)[0] == rows for r, rows in enumerate(self.rows))

    # ``==`` tells layouts apart: torch keys its caches (redistribution plans, sharding
    # propagation) on placement equality, so a RowShard must never find an entry made for
    # other rows. It equals a plain Shard(0) (not a subclass) only where its rows are
    # torch's even split, where both mean the same. ``!=`` is ``not ==``.
    def _key(self):
        return (type(self), self.rows, getattr(self, "offset", 0))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (RowShard, NestedRowShard)):
            return other._key() == self._key()
        return self._even and type(other) is Shard and other.dim == 0

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(Shard(0)) if self._even else hash(self._key())

    def is_even(self) -> bool:
        """True when the rows are torch's own ``Shard(0)`` split (``torch.chunk``'s)."""
        return self._even

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rows={self.rows})"

    __str__ = __repr__

    def __reduce__(self):
        return (type(self), (self.rows,))

    def __deepcopy__(self, memo):
        return type(self)(self.rows)

    def _check_mesh(self, num_chunks: int) -> None:
        if num_chunks != len(self.rows):
            raise ValueError(
                f"{self!r} describes {len(self.rows)} shards but the mesh axis has {num_chunks} ranks; "
                "redistribute MFSDP v2 tensors only on the mesh they were created on."
            )

    # Where rank r's rows are --------------------------------------------------------
    def _local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank) -> Tuple[int, int]:
        self._check_mesh(num_chunks)
        if curr_local_size != sum(self.rows):
            raise ValueError(f"{self!r} holds {sum(self.rows)} rows, the tensor has {curr_local_size}.")
        return self.rows[rank], self.starts[rank]

    def local_shard_size_and_offset(self, curr_local_size, num_chunks, rank):
        return self._local_shard_size_and_offset(curr_local_size, num_chunks, rank)

    def _split_tensor(self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True,
                      contiguous: bool = True) -> Tuple[List[torch.Tensor], List[int]]:
        self._check_mesh(num_chunks)
        widest = max(self.rows, default=0)
        pieces, pads = [], []
        for start, rows in zip(self.starts, self.rows):
            piece = tensor.narrow(0, start, rows)
            pad = widest - rows
            if with_padding and pad:
                piece = torch.cat([piece, piece.new_zeros((pad,) + tuple(piece.shape[1:]))])
            pieces.append(piece.contiguous() if contiguous else piece)
            pads.append(pad if with_padding else 0)
        return pieces, pads

    # Collectives --------------------------------------------------------------------
    def _to_replicate_tensor(self, local_tensor, mesh, mesh_dim: int, current_logical_shape) -> torch.Tensor:
        """All-gather the uneven pieces (padded to the widest) and keep the true rows."""
        num_chunks = mesh.size(mesh_dim=mesh_dim)
        self._check_mesh(num_chunks)
        widest = max(self.rows, default=0)
        pad = widest - local_tensor.shape[0]
        if pad:
            local_tensor = torch.cat([local_tensor, local_tensor.new_zeros((pad,) + tuple(local_tensor.shape[1:]))])
        gathered = funcol.all_gather_single(local_tensor.contiguous(), 0, (mesh, mesh_dim))
        gathered = funcol.wait_tensor(gathered)
        return torch.cat([gathered.narrow(0, i * widest, rows) for i, rows in enumerate(self.rows)])

    def _replicate_to_shard(self, local_tensor, mesh, mesh_dim: int, shard_index) -> torch.Tensor:
        self._check_mesh(mesh.size(mesh_dim=mesh_dim))
        return local_tensor.narrow(0, self.starts[shard_index], self.rows[shard_index]).clone()

    def _reduce_shard_tensor(self, tensor, mesh, reduce_op: str, mesh_dim: int) -> torch.Tensor:
        """Partial -> RowShard: reduce-scatter the padded pieces, keep this rank's rows."""
        if mesh.get_coordinate() is None:
            return tensor
        pieces, _ = self._split_tensor(tensor, mesh.size(mesh_dim=mesh_dim), with_padding=True)
        out = funcol.reduce_scatter_single(torch.cat(pieces), reduce_op, 0, (mesh, mesh_dim))
        out = funcol.wait_tensor(out)
        return out.narrow(0, 0, self.rows[mesh.get_local_rank(mesh_dim)])

    def _to_new_shard_dim(self, local_tensor, mesh, mesh_dim, current_logical_shape, new_shard_dim):
        if self.is_even():
            return super()._to_new_shard_dim(local_tensor, mesh, mesh_dim, current_logical_shape, new_shard_dim)
        raise NotImplementedError(
            f"{self!r}: moving an MFSDP v2 row shard to another dimension is not supported; "
            "redistribute to Replicate() first (or call full_tensor())."
        )


class NestedRowShard(Shard):
    """One axis of HFSDP's optimizer shards: an outer split of each inner row shard.

    DTensor composes shardings of one dimension left to right (outer axis first); HFSDP
    splits the inner axis first. The local shape and global offset are still exact (the
    outer placement carries this rank's final ``(rows, offset)``, the inner one passes
    through), so operators and checkpoint metadata work; every redistribution raises."""

    MESSAGE = (
        "HFSDP optimizer shards are nested (an outer split of each inner row shard), which DTensor "
        "cannot redistribute; read full values with unit.unshard() and the unsharded parameters, or "
        "save a checkpoint with save_checkpoint()."
    )

    def __init__(self, rows: Optional[int] = None, offset: int = 0):
        super().__init__(0)
        self.rows, self.offset = rows, offset  # rows=None: the inner axis (passes through)
        self._even = False  # a nested split is never torch's

    _key, __eq__, __ne__, __hash__ = RowShard._key, RowShard.__eq__, RowShard.__ne__, RowShard.__hash__

    def __repr__(self) -> str:
        return f"NestedRowShard(rows={self.rows}, offset={self.offset})"

    __str__ = __repr__

    def __reduce__(self):
        return (type(self), (self.rows, self.offset))

    def __deepcopy__(self, memo):
        return type(self)(self.rows, self.offset)

    def _local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank) -> Tuple[int, int]:
        if self.rows is None:
            return curr_local_size, 0
        return self.rows, self.offset

    def local_shard_size_and_offset(self, curr_local_size, num_chunks, rank):
        return self._local_shard_size_and_offset(curr_local_size, num_chunks, rank)

    def is_even(self) -> bool:
        return False  # a nested split is never torch's

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError(self.MESSAGE)

    _to_replicate_tensor = _replicate_to_shard = _reduce_shard_tensor = _split_tensor = _refuse
    _to_new_shard_dim = _refuse
