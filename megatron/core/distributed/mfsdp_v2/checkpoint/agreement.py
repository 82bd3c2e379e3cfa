"""Which ranks take part in a checkpoint call, and how they agree on its outcome.

Every check before a save or load ends in ``Comm.agree``: the ranks all-gather their
error (or None) and all raise the first one. So a bad checkpoint raises the same error on
every rank instead of one rank raising while the others wait in a collective.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence

import torch.distributed as dist

from .errors import CheckpointError


@dataclasses.dataclass
class Comm:
    """How this call communicates: ``no_dist`` (one process) or over ``group``
    (None: the default group)."""

    no_dist: bool
    group: Any = None

    @property
    def rank(self) -> int:
        return 0 if self.no_dist else dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return 1 if self.no_dist else dist.get_world_size(self.group)

    def all_gather(self, obj: Any) -> List[Any]:
        if self.no_dist:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def union(self, mapping: dict) -> dict:
        """Every rank's ``mapping`` merged (rank order; later ranks add their new keys).
        Ranks that hold different parts of a model (pipeline stages) describe the whole
        model together; ranks that hold the same names give back their own mapping."""
        merged: dict = {}
        for part in self.all_gather(mapping):
            for key, value in part.items():
                merged.setdefault(key, value)
        return merged

    def barrier(self) -> None:
        if not self.no_dist:
            dist.barrier(group=self.group)

    def agree(self, error: Optional[str], exc_type=CheckpointError) -> None:
        """Raise ``error`` (or another rank's) on every rank if any rank has one."""
        errors = self.all_gather(error)
        for rank, message in enumerate(errors):
            if message:
                prefix = "" if self.size == 1 or rank == self.rank else f"(rank {rank} of the checkpoint group) "
                raise exc_type(prefix + message)


def resolve_comm(meshes: Sequence[Any], process_group: Optional[dist.ProcessGroup]) -> Comm:
    """The ranks of a call: ``process_group`` if given; else the world when the units'
    device meshes (``meshes``, one per unit) cover it together, or the one mesh they all
    share; no communication for a plain model."""
    if process_group is not None:
        return Comm(no_dist=False, group=process_group)
    if not meshes:
        # A plain model: the calling process reads / writes everything by itself.
        return Comm(no_dist=True)
    # Units may live on sub-meshes (an expert-data-parallel mesh beside the data-parallel
    # one): together they must cover the world, or share one mesh.
    rank_sets = {tuple(sorted(mesh.mesh.flatten().tolist())) for mesh in meshes}
    ranks = sorted(set().union(*rank_sets))
    if len(rank_sets) > 1 and ranks != list(range(dist.get_world_size())):
        raise ValueError(
            "the model's FSDP units live on different sets of ranks; pass process_group= covering "
            "all of them to save_checkpoint / load_checkpoint."
        )
    if ranks == list(range(dist.get_world_size())):
        return Comm(no_dist=False, group=None)
    if meshes[0].ndim == 1:
        return Comm(no_dist=False, group=meshes[0].get_group(0))
    raise ValueError(
        f"the model's mesh covers ranks {ranks}, not the whole world; pass process_group= (a group of exactly "
        "these ranks, e.g. dist.new_group(ranks)) to save_checkpoint / load_checkpoint."
    )
