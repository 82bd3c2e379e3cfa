"""The named device mesh of a run and the process groups carved from it.

Axes, outermost first (Megatron's order: tensor parallelism innermost, so one TP group is
a block of consecutive ranks, i.e. GPUs of one node)::

    TP = 1:  ("dp",)                 or ("outer", "inner")          for HSDP/HFSDP
    TP > 1:  ("dp", "tp")            or ("outer", "inner", "tp")

The FSDP engine is handed ``dp_mesh``, the sub-mesh of the data-parallel axes only, and
shards every parameter over it; a tensor-parallel parameter is a plain TP-local tensor
(the rank's piece of the global one, see ``megatron/core/global_slices.py``), so the
engine never communicates over ``tp``. All TP ranks of one data-parallel rank read the
same batch (``dp_rank``/``dp_size``).

``initialize_model_parallel`` builds the state once per process and the getters read it
(Megatron's ``parallel_state`` API): model providers, which receive only the arguments,
take the TP group from here. Everything below the provider receives it explicitly
(``TransformerConfig.tp_group``). New axes (expert parallelism) extend ``ParallelState``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class ParallelState:
    world_mesh: Any  # DeviceMesh over every rank, axes as in the module docstring
    dp_mesh: Any  # the data-parallel sub-mesh (what fully_shard shards over)
    tp_group: Optional[dist.ProcessGroup]  # None at TP size 1
    tp_rank: int
    tp_size: int
    dp_group: dist.ProcessGroup  # every data-parallel rank of this TP coordinate, flattened
    dp_rank: int
    dp_size: int

    @property
    def dp_axes(self) -> Tuple[str, ...]:
        return tuple(self.dp_mesh.mesh_dim_names)


def build_parallel_state(tensor_model_parallel_size: int = 1, dp_outer_size: int = 1,
                         device_type: str = "cpu") -> ParallelState:
    """The mesh for ``world = dp_outer x dp_inner x tp`` (every rank calls it)."""
    from torch.distributed.device_mesh import init_device_mesh

    world, tp = dist.get_world_size(), int(tensor_model_parallel_size)
    if tp < 1 or world % (tp * dp_outer_size):
        raise ValueError(
            f"--tensor-model-parallel-size ({tp}) x --num-distributed-optimizer-instances ({dp_outer_size}) "
            f"must divide the world size ({world}); pick sizes whose product divides {world}."
        )
    dp = world // tp
    dp_shape, dp_names = ((dp_outer_size, dp // dp_outer_size), ("outer", "inner")) if dp_outer_size > 1 else \
        ((dp,), ("dp",))
    if tp == 1:
        world_mesh = init_device_mesh(device_type, dp_shape, mesh_dim_names=dp_names)
        dp_mesh = world_mesh
    else:
        world_mesh = init_device_mesh(device_type, dp_shape + (tp,), mesh_dim_names=dp_names + ("tp",))
        dp_mesh = world_mesh[dp_names]
    if len(dp_names) == 1:
        dp_group = dp_mesh.get_group()
    else:
        dp_group = dp_mesh._flatten("dp_flat").get_group()  # all DP ranks, for data and token counts
    return ParallelState(
        world_mesh=world_mesh,
        dp_mesh=dp_mesh,
        tp_group=world_mesh.get_group("tp") if tp > 1 else None,
        tp_rank=world_mesh.get_local_rank("tp") if tp > 1 else 0,
        tp_size=tp,
        dp_group=dp_group,
        dp_rank=dist.get_rank(dp_group),
        dp_size=dp,
    )


_STATE: Optional[ParallelState] = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1, dp_outer_size: int = 1,
                              device_type: str = "cpu") -> ParallelState:
    """Build this process's parallel state (after the default process group exists)."""
    global _STATE
    if _STATE is not None:
        raise RuntimeError("model parallelism is already initialized; call destroy_model_parallel() first.")
    _STATE = build_parallel_state(tensor_model_parallel_size, dp_outer_size, device_type)
    return _STATE


def destroy_model_parallel() -> None:
    global _STATE
    _STATE = None


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def get_parallel_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("model parallelism is not initialized; call initialize_model_parallel() first.")
    return _STATE


def get_tensor_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """The TP group, or None when model parallelism is not initialized or TP is 1."""
    return _STATE.tp_group if _STATE is not None else None


def get_tensor_model_parallel_world_size() -> int:
    return _STATE.tp_size if _STATE is not None else 1


def get_tensor_model_parallel_rank() -> int:
    return _STATE.tp_rank if _STATE is not None else 0
