"""Many tensors in one flat buffer, with a placement on every data-parallel axis.

Each of a group's buffers (``main_weight``, ``model_weight``, ``unsharded``, ``main_grad``,
``reduced_grad`` and the temporaries of a reduction) is a ``FlatBuffer``: a 1-D tensor
and one placement per data-parallel axis of the group (outer first, as in
``Placements.dp_axes``):

* ``Shard(0)``: this rank holds its shard of that axis (``FlatLayout`` says which rows),
* ``Replicate()``: every rank of that axis holds the same values,
* ``Partial()``: every rank holds a partial sum still to be reduced over that axis.

``redistribute(placements, out=...)`` moves a buffer to new placements and chooses the
collective from the change, the way DTensor and upstream's DBuffer do:

    Shard -> Replicate    all-gather        (unshard; refresh weights after the step)
    Partial -> Shard      reduce-scatter    (gradients, ZeRO-1/2/3, HFSDP's outer axis)
    Partial -> Replicate  all-reduce        (gradients, no_shard, HSDP's outer axis)

One axis changes per call; anything else raises. The group's strategy is then data: the
placements of each buffer come from the user's ``Placements`` (see ``Strategy``), and
each step of the training loop is one transition between them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

from . import work as comm


@dataclasses.dataclass(frozen=True)
class CommResources:
    """What a group is given by its context: the device, the two streams, the counter,
    and the replica reducer (``replica.py``) when the outer replica axis is not a mesh axis."""

    device: Any  # DeviceHandle
    allgather_stream: Any
    reduce_scatter_stream: Any
    counter: comm.CollectiveCounter
    replica_reducer: Any = None


_PLACEMENTS = {"S": Shard(0), "R": Replicate(), "P": Partial("avg")}


@dataclasses.dataclass(frozen=True)
class FlatBuffer:
    """A flat tensor, its placement code per axis ("S", "R", "P"; outer first) and the
    process group of each axis."""

    data: torch.Tensor
    codes: str
    groups: Tuple[dist.ProcessGroup, ...]

    def __post_init__(self):
        if len(self.codes) != len(self.groups) or set(self.codes) - set(_PLACEMENTS):
            raise ValueError(f"placement codes {self.codes!r} for {len(self.groups)} mesh axes; use S, R or P per axis.")

    def like(self, data: torch.Tensor, codes: str) -> "FlatBuffer":
        """Another buffer on the same axes (e.g. the output of a collective)."""
        return FlatBuffer(data, codes, self.groups)

    def redistribute(
        self,
        out: "FlatBuffer",
        resources: CommResources,
        stream,
        *,
        divisor: float = 1.0,
        post_ops: Sequence[comm.PostOp] = (),
    ) -> comm.CollectiveWork:
        """Issue the collective that takes this buffer to ``out.codes``, into ``out.data``
        (the same tensor for an all-reduce, which works in place)."""
        changed = [i for i, (a, b) in enumerate(zip(self.codes, out.codes)) if a != b]
        if len(changed) != 1:
            raise NotImplementedError(
                f"redistribute {self.codes} -> {out.codes}: exactly one mesh axis may change per call."
            )
        axis = changed[0]
        group, move = self.groups[axis], self.codes[axis] + out.codes[axis]
        kwargs = dict(device=resources.device, stream=stream, post_ops=post_ops, counter=resources.counter)
        if move == "SR":
            if divisor != 1.0:
                raise ValueError("an all-gather does not divide: pass divisor=1.")
            return comm.all_gather(out.data, self.data, group, **kwargs)
        if move == "PS":
            return comm.reduce_scatter(out.data, self.data, group, divisor=divisor, **kwargs)
        if move == "PR":
            if out.data is not self.data:
                raise ValueError("Partial -> Replicate reduces in place: give out the same tensor.")
            return comm.all_reduce(self.data, group, divisor=divisor, **kwargs)
        raise NotImplementedError(
            f"redistribute on mesh axis {axis}: {_PLACEMENTS[move[0]]} -> {_PLACEMENTS[move[1]]} has no "
            "collective (supported: Shard->Replicate, Partial->Shard, Partial->Replicate)."
        )


@dataclasses.dataclass(frozen=True)
class DataParallelAxes:
    """A parameter group's data-parallel axes: their process groups (outer first, as the
    strategy's placement codes) and this rank's size and rank on each. ``flat`` makes a
    ``FlatBuffer`` on them. Without an outer axis, ``outer_size`` is 1 and ``outer_rank`` 0."""

    groups: Tuple[dist.ProcessGroup, ...]
    inner_size: int
    inner_rank: int
    outer_size: int
    outer_rank: int

    @classmethod
    def of(cls, mesh, strategy) -> "DataParallelAxes":
        """The axes ``strategy`` names (``inner_dim``, ``outer_dim``) on ``mesh``."""
        inner = mesh.get_group(strategy.inner_dim)
        outer = mesh.get_group(strategy.outer_dim) if strategy.outer_dim is not None else None
        groups = tuple(g for g in (outer, inner) if g is not None)
        outer_size, outer_rank = (1, 0) if outer is None else (dist.get_world_size(outer), dist.get_rank(outer))
        return cls(groups, dist.get_world_size(inner), dist.get_rank(inner), outer_size, outer_rank)

    @property
    def inner_group(self) -> dist.ProcessGroup:
        return self.groups[-1]

    @property
    def outer_group(self):
        """The outer axis' process group, or None (a single data-parallel axis)."""
        return self.groups[0] if len(self.groups) == 2 else None

    def flat(self, data: torch.Tensor, codes: str) -> FlatBuffer:
        """``data`` as a flat buffer with placement ``codes`` on these axes."""
        return FlatBuffer(data, codes, self.groups)


def single_axis_steps(source: str, target: str) -> list:
    """The one-axis moves from placement codes ``source`` to ``target``, inner axis first
    (the inner reduction precedes the outer one): ``[(axis, codes before, codes after)]``."""
    steps, codes = [], source
    for axis in reversed(range(len(source))):
        if codes[axis] != target[axis]:
            after = codes[:axis] + target[axis] + codes[axis + 1:]
            steps.append((axis, codes, after))
            codes = after
    return steps


def storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def free_storage(tensor: torch.Tensor, device) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        device.resize_storage(storage, 0)


def alloc_storage(tensor: torch.Tensor, device) -> None:
    storage = tensor.untyped_storage()
    needed = tensor.numel() * tensor.element_size() + tensor.storage_offset() * tensor.element_size()
    if storage.size() < needed:
        device.resize_storage(storage, needed)
