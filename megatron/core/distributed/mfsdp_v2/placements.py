"""Placements: how parameters, gradients and optimizer state lie on the data-parallel mesh.

Every strategy (no_shard, ZeRO-1/2/3, HSDP, HFSDP) is one ``Placements`` value: one
torch DTensor placement per data-parallel mesh axis for each of the three roles. On a
2-D mesh the axes are (outer, inner): the inner axis shards, the outer axis replicates
parameters and reduces gradients only on the last microbatch.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple, Union

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

Axis = Union[int, str]


def _is_shard0(p: Placement) -> bool:
    return isinstance(p, Shard) and p.dim == 0


@dataclasses.dataclass(frozen=True)
class Placements:
    """``Placements(dp_axes, parameter, gradient, optimizer)``: one strategy.

    Args:
        dp_axes: the data-parallel mesh dimensions, outer first (indices or mesh dim
            names; a single one may be given bare).
        parameter: where compute weights rest between uses, one placement per axis:
            ``Shard(0)`` (ZeRO-3, gathered per use) or ``Replicate()``.
        gradient: where gradients go after each microbatch: ``Shard(0)`` (reduce-scatter),
            ``Partial("avg")`` (kept local until the last microbatch) or ``Replicate()``.
        optimizer: where the optimizer's main weights and state live: ``Shard(0)`` or
            ``Replicate()``.

    Raises:
        ValueError: no axis, an axis named twice, a field without exactly one placement
            per axis, or a placement other than ``Shard(0)``, ``Replicate()``,
            ``Partial("avg")``. Combinations are checked against the mesh by
            ``fully_shard`` (``decode_strategy``).

    The presets are the strategies of docs/mfsdp_v2.md: ``no_shard``, ``zero1``, ``zero2``,
    ``zero3`` (1-D; ``dp_axis`` names the axis) and ``hsdp``, ``hfsdp`` (2-D; ``outer_axis``
    replicates, ``inner_axis`` shards).
    """

    dp_axes: Tuple[Axis, ...]
    parameter: Tuple[Placement, ...]
    gradient: Tuple[Placement, ...]
    optimizer: Tuple[Placement, ...]

    def __post_init__(self):
        for field in ("dp_axes", "parameter", "gradient", "optimizer"):
            value = getattr(self, field)
            if isinstance(value, (str, int, Placement)):
                value = (value,)
            object.__setattr__(self, field, tuple(value))
        if len(self.dp_axes) == 0:
            raise ValueError("Placements.dp_axes must name at least one data-parallel mesh axis.")
        if len(set(self.dp_axes)) != len(self.dp_axes):
            raise ValueError(f"Placements.dp_axes {self.dp_axes} names an axis twice; list each axis once.")
        for field in ("parameter", "gradient", "optimizer"):
            value = getattr(self, field)
            if len(value) != len(self.dp_axes):
                raise ValueError(
                    f"Placements.{field} has {len(value)} placements but dp_axes has "
                    f"{len(self.dp_axes)}; give exactly one placement per data-parallel axis."
                )
            for p in value:
                if not isinstance(p, (Shard, Replicate, Partial)):
                    raise ValueError(f"Placements.{field} holds {p!r}; use Shard(0), Replicate() or Partial('avg').")

    # Presets (the strategy table of docs/mfsdp_v2.md) ----------------------------------
    @classmethod
    def no_shard(cls, dp_axis: Axis = 0) -> "Placements":
        return cls((dp_axis,), (Replicate(),), (Partial("avg"),), (Replicate(),))

    @classmethod
    def zero1(cls, dp_axis: Axis = 0) -> "Placements":
        return cls((dp_axis,), (Replicate(),), (Partial("avg"),), (Shard(0),))

    @classmethod
    def zero2(cls, dp_axis: Axis = 0) -> "Placements":
        return cls((dp_axis,), (Replicate(),), (Shard(0),), (Shard(0),))

    @classmethod
    def zero3(cls, dp_axis: Axis = 0) -> "Placements":
        return cls((dp_axis,), (Shard(0),), (Shard(0),), (Shard(0),))

    @classmethod
    def hsdp(cls, outer_axis: Axis = 0, inner_axis: Axis = 1) -> "Placements":
        return cls(
            (outer_axis, inner_axis),
            (Replicate(), Shard(0)),
            (Partial("avg"), Shard(0)),
            (Replicate(), Shard(0)),
        )

    @classmethod
    def hfsdp(cls, outer_axis: Axis = 0, inner_axis: Axis = 1) -> "Placements":
        return cls(
            (outer_axis, inner_axis),
            (Replicate(), Shard(0)),
            (Partial("avg"), Shard(0)),
            (Shard(0), Shard(0)),
        )


@dataclasses.dataclass(frozen=True)
class Strategy:
    """What the engine does for one ``Placements`` on one mesh (decoded once per unit).

    ``parameter``, ``gradient`` and ``optimizer`` hold one placement code per axis, outer
    first: "S" Shard(0), "R" Replicate, "P" Partial. They are the placements of the
    group's buffers (see ``flat_buffer.py``): a step of training is a transition between
    them (unshard: parameter -> all "R"; reduction: all "P" -> gradient -> optimizer;
    refresh after the optimizer step: optimizer -> parameter)."""

    outer_dim: int | None  # mesh dim of the outer (replicate) axis, None on a 1-D layout
    inner_dim: int  # mesh dim of the sharding axis
    parameter: str
    gradient: str
    optimizer: str

    @property
    def param_sharded(self) -> bool:  # ZeRO-3: parameters live sharded at rest
        return self.parameter[-1] == "S"

    @property
    def grad_sharded(self) -> bool:  # ZeRO-2/3: reduce-scatter every microbatch
        return self.gradient[-1] == "S"

    @property
    def optim_sharded(self) -> bool:  # ZeRO-1/2/3: optimizer state sharded on the inner axis
        return self.optimizer[-1] == "S"

    @property
    def outer_optim_sharded(self) -> bool:  # HFSDP: optimizer state also sharded on the outer axis
        return self.outer_dim is not None and self.optimizer[0] == "S"

    @property
    def name(self) -> str:
        inner = {
            (False, False, False): "no_shard",
            (False, False, True): "zero1",
            (False, True, True): "zero2",
            (True, True, True): "zero3",
        }[(self.param_sharded, self.grad_sharded, self.optim_sharded)]
        if self.outer_dim is None:
            return inner
        return ("hfsdp" if self.outer_optim_sharded else "hsdp") + f"({inner})"


def _mesh_dim(mesh: DeviceMesh, axis: Axis) -> int:
    if isinstance(axis, str):
        names = mesh.mesh_dim_names or ()
        if axis not in names:
            raise ValueError(f"dp axis {axis!r} is not a dimension of the mesh (its names are {names}).")
        return names.index(axis)
    if not 0 <= axis < mesh.ndim:
        raise ValueError(f"dp axis {axis} is out of range for a {mesh.ndim}-D mesh.")
    return axis


# The (parameter, gradient, optimizer) codes of the inner axis: no_shard, ZeRO-1, 2, 3.
_INNER_COMBOS = (("R", "P", "R"), ("R", "P", "S"), ("R", "S", "S"), ("S", "S", "S"))


def _code(p: Placement) -> str:
    if _is_shard0(p):
        return "S"
    if isinstance(p, Shard):
        raise NotImplementedError(
            f"{p} is not supported: MFSDP v2 shards along dim 0 only; use Shard(0)."
        )
    return "R" if isinstance(p, Replicate) else "P"


def decode_strategy(placements: Placements, mesh: DeviceMesh) -> Strategy:
    """Map placements to a strategy, or raise saying which combinations exist."""
    dims = [_mesh_dim(mesh, a) for a in placements.dp_axes]
    if len(set(dims)) != len(dims):
        raise ValueError(
            f"Placements.dp_axes {placements.dp_axes} names mesh dimension {dims} more than once; "
            "list each data-parallel mesh axis once."
        )
    if dims != sorted(dims):
        raise ValueError(
            f"Placements.dp_axes {placements.dp_axes} must follow the mesh's dimension order "
            "(outer axis first, inner axis second)."
        )
    if len(dims) > 2:
        raise NotImplementedError("MFSDP v2 supports 1-D (dp) and 2-D (outer, inner) data-parallel meshes.")
    codes = [tuple(_code(getattr(placements, f)[i]) for f in ("parameter", "gradient", "optimizer")) for i in range(len(dims))]
    supported = "no_shard, zero1, zero2, zero3 (1-D) and hsdp, hfsdp (2-D); see Placements presets"
    inner = codes[-1]
    if inner not in _INNER_COMBOS:
        raise NotImplementedError(f"Placement combination {inner} on the inner axis is not supported: use {supported}.")
    outer_dim = None
    if len(dims) == 2:
        outer = codes[0]
        if outer not in (("R", "P", "R"), ("R", "P", "S")):
            raise NotImplementedError(f"Placement combination {outer} on the outer axis is not supported: use {supported}.")
        if outer == ("R", "P", "S") and inner != ("S", "S", "S"):
            raise NotImplementedError(
                "HFSDP (optimizer sharded on the outer axis) needs ZeRO-3 on the inner axis: "
                "Shard(0) parameters, gradients and optimizer state (Placements.hfsdp())."
            )
        outer_dim = dims[0]
    by_role = ["".join(c[i] for c in codes) for i in range(3)]
    return Strategy(outer_dim, dims[-1], *by_role)
