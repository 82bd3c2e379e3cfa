"""A matrix's whole value from the rows a data-parallel rank holds, and back.

Under MFSDP a parameter (its main weight, ``.grad`` and optimizer state) is a DTensor over
the data-parallel mesh whose local part is a contiguous range of dim-0 rows: a plain
``Shard(0)`` where the rows are torch's even split, an engine ``RowShard`` with every
rank's row count where not, ``Replicate`` on the axes that do not shard it (ZeRO-0, the
outer axis of HSDP). An optimizer that needs the whole matrix (Muon orthogonalizes it)
gathers the rows over the one sharded axis and keeps its own rows of the result.
HFSDP's nested rows (``NestedRowShard``) are refused; the trainer refuses Muon with HFSDP
at parse time.

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
        if DTensor is None or not isinstance(tensor, DTensor):
            return
        sharded = [(d, p) for d, p in enumerate(tensor.placements) if p.is_shard()]
        if not sharded:
            return
        if type(sharded[0][1]).__name__ == "NestedRowShard" or len(sharded) > 1:
            raise NotImplementedError(
                "this optimizer needs whole matrices, and a parameter sharded over two mesh axes (HFSDP) "
                "cannot be gathered; use HSDP (--outer-dp-sharding-strategy no_shard) or ZeRO-1/2/3.")
        dim, placement = sharded[0]
        if placement.dim != 0:
            raise NotImplementedError(f"a parameter sharded on dim {placement.dim}; only dim-0 row shards are gathered.")
        mesh = tensor.device_mesh
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
        return whole.narrow(0, self.starts[self.rank], self.counts[self.rank])


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
