"""Strategy cases and models for the strategy / precision tests (1, 2 or 4 gloo ranks).

Nothing here asserts. Wrapping, reference training, full-tensor rebuilding and checks are
the shared ``_dist_helpers``.

Meshes: 1-D strategies use a 1-D mesh over the world. HSDP/HFSDP use a 2-D mesh with dims
named ("outer", "inner"): 2x2 at 4 ranks, both (2, 1) and (1, 2) at 2 ranks (so both the
outer reductions and the inner sharding are exercised), (1, 1) at 1 rank.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from _dist_helpers import H, mesh_1d, mesh_2d, world
from megatron.core.distributed.mfsdp_v2 import Placements

STRATEGIES = ["no_shard", "zero1", "zero2", "zero3", "hsdp", "hfsdp"]
HYBRID = ("hsdp", "hfsdp")
W = 12  # inner width (co-prime-ish with H so rows span shard boundaries)


def hybrid_shapes() -> List[Tuple[int, int]]:
    n = world()
    if n == 1:
        return [(1, 1)]
    if n == 2:
        return [(2, 1), (1, 2)]
    if n == 4:
        return [(2, 2)]
    return [(n // 2, 2)] if n % 2 == 0 else [(n, 1)]


def strategy_cases() -> List[Tuple[str, Optional[Tuple[int, int]]]]:
    """(strategy, 2-D mesh shape or None): hybrids once per mesh shape of this world."""
    out = []
    for name in STRATEGIES:
        if name in HYBRID:
            out.extend((name, shape) for shape in hybrid_shapes())
        else:
            out.append((name, None))
    return out


def case_id(case) -> str:
    name, shape = case
    return name if shape is None else f"{name}-{shape[0]}x{shape[1]}"


def sharding(case) -> dict:
    """``wrap`` keywords (mesh, placements) for a strategy case; hybrids name their axes
    by mesh dim name."""
    name, shape = case
    if name in HYBRID:
        return {"mesh": mesh_2d(shape), "placements": getattr(Placements, name)("outer", "inner")}
    return {"mesh": mesh_1d(), "placements": getattr(Placements, name)()}


def sizes(case) -> Tuple[int, int]:
    """(outer size M, inner size N) of a case's mesh; M = 1 for 1-D strategies."""
    name, shape = case
    if shape is None:
        return 1, world()
    return shape


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, w: int = W):
        super().__init__()
        self.lin = nn.Linear(w, w)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    """Units blocks[0], blocks[1] and the root (which owns ``inp`` and ``head``)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(H, W)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(W, H)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def units(self):
        return [self.blocks[0], self.blocks[1], self]

    # Parameter counts of each unit (what the layouts must hold), from the shapes alone.
    @staticmethod
    def unit_shapes():
        lin = [torch.Size((W, W)), torch.Size((W,))]
        root = [torch.Size((W, H)), torch.Size((W,)), torch.Size((H, W)), torch.Size((H,))]
        return [lin, lin, root]


def groups_of(ctx):
    """[(unit, group)] in unit registration order."""
    return [(unit, g) for unit in ctx.units for g in unit.parameter_groups]


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def numel(shapes: Sequence[torch.Size]) -> int:
    return sum(math.prod(s) for s in shapes)


class DistTap:
    """Counts the calls made on ``torch.distributed`` while active, independently of the
    engine's own counter: a collective issued around the work wrapper is seen too.

    Records ``(kind, bytes of this rank's input, group size)`` of each call as the
    backend sees it (point-to-point messages and all-to-alls included: on gloo the
    engine's all-gathers and reduce-scatters travel as those, see ``wire_records``); a
    call made inside another tapped call counts once."""

    KINDS = {
        "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
        "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
        "all_reduce": "all_reduce", "all_to_all_single": "all_to_all", "isend": "send", "irecv": "recv",
    }
    # Position of the tensor a rank contributes, and of the group, in each kind's signature.
    TENSOR_ARG = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "all_reduce": 0, "send": 0, "recv": 0}
    GROUP_ARG = {"all_gather": 2, "reduce_scatter": 3, "all_to_all": 4, "all_reduce": 2, "send": 2, "recv": 2}

    def __init__(self):
        self.records: List[Tuple[str, int, int]] = []
        self._originals = {}
        self._depth = 0

    def _wrap(self, name: str, fn):
        kind = self.KINDS[name]

        def tapped(*args, **kwargs):
            if self._depth == 0:
                at = self.TENSOR_ARG[kind]
                tensor = args[at] if len(args) > at else kwargs["input" if at else "tensor"]
                group = kwargs.get("group", args[self.GROUP_ARG[kind]] if len(args) > self.GROUP_ARG[kind] else None)
                self.records.append((kind, tensor.numel() * tensor.element_size(), dist.get_world_size(group)))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return tapped

    def __enter__(self) -> "DistTap":
        for name in self.KINDS:
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._originals[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()


def wire_records(records, backend: str) -> List[Tuple[str, int, int]]:
    """What the backend must see for the engine's counted collectives ``(kind, bytes,
    group size)``. On gloo (``gloo_wire.py``) an all-gather of a B-byte shard over N ranks
    is N-1 sends and N-1 receives of B bytes, a reduce-scatter of a B-byte input N-1
    sends and receives of B/N bytes, and both are local copies over one rank; on any
    other backend each collective is itself."""
    out = []
    for kind, nbytes, size in records:
        if backend == "gloo" and kind == "all_gather":
            out += [("send", nbytes, size), ("recv", nbytes, size)] * (size - 1)
        elif backend == "gloo" and kind == "reduce_scatter":
            out += [("send", nbytes // size, size), ("recv", nbytes // size, size)] * (size - 1)
        else:
            out.append((kind, nbytes, size))
    return out
