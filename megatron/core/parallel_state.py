"""The one named device mesh of a run, and every process group carved from it.

Axes, outermost first, in Megatron's rank order (tensor parallelism innermost, so that
one TP group is a block of consecutive ranks, i.e. GPUs of one node; pipeline stages
outermost, so that a stage is a block of nodes)::

    ("pp", "dp", "cp", "tp")                    or, with HSDP/HFSDP instances,
    ("pp", "outer", "inner", "cp", "tp")

Every axis is present, of size 1 where unused, so that a rank's coordinates always read
the same way. The FSDP engine is handed ``dp_mesh``, the sub-mesh of the data-parallel
axes of this rank's pipeline stage, and shards every dense parameter over it; a
tensor-parallel parameter is a plain TP-local tensor (the rank's piece of the global one,
see ``megatron/core/global_slices.py``), so the engine never communicates over ``tp``,
and a pipeline stage holds only its own layers, so it never communicates over ``pp``.
All TP, PP and CP ranks of one data-parallel rank read the same batch (``dp_rank``/``dp_size``).

Context parallelism: the CP ranks of a data-parallel rank hold the same parameters and
see different tokens of the same sequences, so for the engine they are data-parallel
ranks like any other: with cp > 1 it shards over ``dp_cp_mesh``, the data-parallel axes
with ``cp`` folded into the innermost one (1-D ``("dp",)`` over dp x cp ranks, or under
HSDP ``("outer", "inner")`` with inner x cp ranks inside; a separate 2-D mesh would mean
replicating over CP). Token counts for the loss normalization run over ``dp_cp_group``.

The expert view reads the same ranks differently: within one pipeline stage the ranks
(data-parallel x CP x TP, in that order) are ``("expert_dp", "ep", "tp")``, or
``("expert_outer", "expert_inner", "ep", "tp")`` under HSDP/HFSDP, where this ``tp`` axis
is the expert tensor-parallel size (``--expert-tensor-parallel-size``, default the TP
size: then it is the world mesh's ``tp`` axis and ``(expert_dp, ep)`` its data-parallel
ranks, CP folded in as for ``dp_cp_mesh``), innermost as in upstream's expert rank
generator (etp, then ep, then expert-dp). Under CP each rank routes its own tokens, so
for the experts CP ranks are data-parallel ranks like any other.
``megatron/core/transformer/moe/expert_parallel.py`` says why the experts are laid out
so. Both views come from one tensor of ranks, so their groups always agree.

``initialize_model_parallel`` builds the state once per process and the getters read it
(Megatron's ``parallel_state`` API): model providers, which receive only the arguments,
take the groups from here. Everything below the provider receives them explicitly
(``TransformerConfig.tp_group``, the expert layout, the schedule's ``pp`` groups).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megatron.core.torch_private import flatten_mesh


@dataclasses.dataclass(frozen=True)
class ParallelState:
    world_mesh: Any  # DeviceMesh over every rank, axes as in the module docstring
    dp_mesh: Any  # the data-parallel sub-mesh of this rank's stage (what fully_shard shards over)
    tp_group: Optional[dist.ProcessGroup]  # None at TP size 1
    tp_rank: int
    tp_size: int
    dp_group: dist.ProcessGroup  # every data-parallel rank of this stage and TP coordinate, flattened
    dp_rank: int
    dp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    vp_size: int = 1  # model chunks per pipeline rank (virtual stages; the interleaved schedule when > 1)
    # Two groups over the same pipeline ranks: activations flow forward on one, their
    # gradients backward on the other, so that the two message streams between a pair of
    # ranks never interleave (on NCCL, messages of one communicator match in posting order).
    pp_group: Optional[dist.ProcessGroup] = None
    pp_grad_group: Optional[dist.ProcessGroup] = None
    pp_ranks: Tuple[int, ...] = ()  # global ranks of this rank's pipeline, by stage
    # The first and the last stage of this rank's pipeline (None unless PP > 1 and this rank
    # is one of them): where a tied embedding/output weight lives twice.
    embedding_group: Optional[dist.ProcessGroup] = None
    cp_size: int = 1
    cp_group: Optional[dist.ProcessGroup] = None  # None at CP size 1
    cp_rank: int = 0
    # (a2a group, p2p group) for cp_comm_type "a2a+p2p" (--hierarchical-context-parallel-sizes)
    hierarchical_cp_groups: Optional[Tuple[dist.ProcessGroup, dist.ProcessGroup]] = None
    # What the engine shards dense parameters over, and the group of the same ranks
    # (loss-token counts): the data-parallel mesh and group at CP size 1.
    dp_cp_mesh: Any = None
    dp_cp_group: Optional[dist.ProcessGroup] = None
    expert_mesh: Any = None  # ("expert_dp", "ep", "tp") or ("expert_outer", "expert_inner", "ep", "tp") of this stage
    ep_size: int = 1
    etp_size: int = 1  # the expert mesh's "tp" axis: --expert-tensor-parallel-size (default the TP size)

    @property
    def dp_axes(self) -> Tuple[str, ...]:
        return tuple(self.dp_mesh.mesh_dim_names)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def _check_sizes(world: int, tp: int, pp: int, cp: int, dp_outer: int, ep: int, etp: int = 1) -> int:
    """The data-parallel size, or a ValueError naming the flags that do not fit."""
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--context-parallel-size", cp), ("--num-distributed-optimizer-instances", dp_outer),
                        ("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp)):
        if int(value) != value or value < 1:
            raise ValueError(f"{flag} must be a whole number >= 1, got {value!r}.")
    if world % (tp * pp * cp * dp_outer):
        raise ValueError(
            f"--tensor-model-parallel-size ({tp}) x --pipeline-model-parallel-size ({pp}) x --context-parallel-size "
            f"({cp}) x --num-distributed-optimizer-instances ({dp_outer}) must divide the world size ({world}); "
            "pick sizes whose product divides it."
        )
    check_expert_mesh_sizes(world, pp, dp_outer, ep, etp)
    return world // (tp * pp * cp)


def check_expert_mesh_sizes(world: int, pp: int, dp_outer: int, ep: int, etp: int) -> None:
    """The expert view cuts one pipeline stage's ranks into (expert-dp, ep, etp) (and the
    expert-dp ranks into the HSDP/HFSDP instances): a ValueError naming the flags unless
    they divide it (upstream: world % (etp x ep x pp) == 0)."""
    stage = world // pp
    if stage % (ep * etp):
        raise ValueError(
            f"--expert-tensor-parallel-size ({etp}) x --expert-model-parallel-size ({ep}) must divide the ranks of "
            f"one pipeline stage ({stage} = world size {world} / --pipeline-model-parallel-size {pp}); pick sizes "
            f"whose product divides {stage}.")
    if dp_outer > 1 and (stage // dp_outer) % (ep * etp):
        raise ValueError(
            f"--expert-tensor-parallel-size ({etp}) x --expert-model-parallel-size ({ep}) must divide the ranks of "
            f"one HSDP/HFSDP instance of a stage ({stage // dp_outer} = {stage} / --num-distributed-optimizer-instances "
            f"{dp_outer}); pick sizes whose product divides {stage // dp_outer}, or fewer instances.")


def build_parallel_state(tensor_model_parallel_size: int = 1, dp_outer_size: int = 1,
                         device_type: str = "cpu", *, pipeline_model_parallel_size: int = 1,
                         context_parallel_size: int = 1, virtual_pipeline_model_parallel_size: Optional[int] = None,
                         expert_model_parallel_size: Optional[int] = None,
                         hierarchical_context_parallel_sizes: Optional[Tuple[int, ...]] = None,
                         expert_tensor_parallel_size: Optional[int] = None) -> ParallelState:
    """The mesh for ``world = pp x dp_outer x dp_inner x cp x tp`` (every rank calls it).

    ``hierarchical_context_parallel_sizes`` (a2a size, p2p size), whose product is the CP
    size: build the groups of cp_comm_type "a2a+p2p" (a2a groups of consecutive CP ranks).

    ``expert_model_parallel_size``: build the expert view too (a MoE model), else None;
    ``expert_tensor_parallel_size`` its ``tp`` axis (default: the TP size).
    Every group is created here, on every rank in the same order, so that a stage without
    expert layers still takes part in creating the other stages' expert groups."""

    world = dist.get_world_size()
    tp, pp, cp = int(tensor_model_parallel_size), int(pipeline_model_parallel_size), int(context_parallel_size)
    ep = 1 if expert_model_parallel_size is None else int(expert_model_parallel_size)
    etp = tp if expert_tensor_parallel_size is None else int(expert_tensor_parallel_size)
    dp = _check_sizes(world, tp, pp, cp, dp_outer_size, ep, etp)
    if cp > 1 and etp != tp:
        raise ValueError(f"--expert-tensor-parallel-size ({etp}) other than --tensor-model-parallel-size ({tp}) "
                         "with --context-parallel-size > 1 is not supported; leave the expert TP size at the TP size.")
    if hierarchical_context_parallel_sizes is not None and math.prod(hierarchical_context_parallel_sizes) != cp:
        raise ValueError(f"--hierarchical-context-parallel-sizes {hierarchical_context_parallel_sizes} must "
                         f"multiply to --context-parallel-size ({cp}); pick sizes whose product is {cp}.")
    dp_shape, dp_names = (((dp_outer_size, dp // dp_outer_size), ("outer", "inner")) if dp_outer_size > 1
                          else ((dp,), ("dp",)))
    ranks = torch.arange(world).reshape((pp,) + dp_shape + (cp, tp))
    world_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("pp",) + dp_names + ("cp", "tp"))
    dp_mesh = world_mesh[dp_names]
    if len(dp_names) == 1:
        dp_group = dp_mesh.get_group()
    else:
        dp_group = flatten_mesh(dp_mesh, "dp_flat").get_group()  # all DP ranks, for data and token counts
    dp_cp_mesh, dp_cp_group, cp_group, hierarchical = dp_mesh, dp_group, None, None
    if cp > 1:
        cp_group = world_mesh.get_group("cp")
        dp_cp_mesh = _dp_cp_mesh(device_type, ranks, dp_names)
        dp_cp_group = dp_cp_mesh.get_group() if len(dp_names) == 1 else flatten_mesh(dp_cp_mesh, "dp_cp_flat").get_group()
        if hierarchical_context_parallel_sizes is not None:
            hierarchical = _hierarchical_cp_groups(ranks, hierarchical_context_parallel_sizes[0])

    pp_rank = world_mesh.get_local_rank("pp")
    pp_group = pp_grad_group = embedding_group = None
    pp_ranks: Tuple[int, ...] = (dist.get_rank(),)
    if pp > 1:
        pp_group = world_mesh.get_group("pp")
        pp_ranks = tuple(dist.get_process_group_ranks(pp_group))
        pp_grad_group = _group_per_line(ranks, lambda line: line, pp_ranks)
        embedding_group = _group_per_line(ranks, lambda line: [line[0], line[-1]], pp_ranks)
        if pp_rank not in (0, pp - 1):
            embedding_group = None
    expert_mesh = None if expert_model_parallel_size is None else \
        build_expert_mesh(device_type, ranks, dp_outer_size, ep, etp)
    return ParallelState(
        world_mesh=world_mesh,
        dp_mesh=dp_mesh,
        tp_group=world_mesh.get_group("tp") if tp > 1 else None,
        tp_rank=world_mesh.get_local_rank("tp"),
        tp_size=tp,
        dp_group=dp_group,
        dp_rank=dist.get_rank(dp_group),
        dp_size=dp,
        pp_rank=pp_rank,
        pp_size=pp,
        vp_size=int(virtual_pipeline_model_parallel_size or 1),
        pp_group=pp_group,
        pp_grad_group=pp_grad_group,
        pp_ranks=pp_ranks,
        embedding_group=embedding_group,
        cp_size=cp,
        cp_group=cp_group,
        cp_rank=world_mesh.get_local_rank("cp"),
        hierarchical_cp_groups=hierarchical,
        dp_cp_mesh=dp_cp_mesh,
        dp_cp_group=dp_cp_group,
        expert_mesh=expert_mesh,
        ep_size=ep,
        etp_size=etp,
    )


def _dp_cp_mesh(device_type: str, ranks: torch.Tensor, dp_names: Tuple[str, ...]):
    """The data-parallel mesh with ``cp`` folded into its innermost axis (same axis names,
    so placements read it as the plain data-parallel mesh). A mesh of its own over the same
    ranks: a DeviceMesh cannot flatten two axes and keep a third beside them."""

    pp, cp, tp = ranks.shape[0], ranks.shape[-2], ranks.shape[-1]
    dp_shape = tuple(ranks.shape[1:-2])
    folded = dp_shape[:-1] + (dp_shape[-1] * cp,)  # (dp, cp) -> dp * cp, cp fastest: Megatron's dp-cp order
    mesh = DeviceMesh(device_type, ranks.reshape((pp,) + folded + (tp,)), mesh_dim_names=("pp",) + dp_names + ("tp",))
    return mesh[dp_names]


def _hierarchical_cp_groups(ranks: torch.Tensor, a2a_size: int):
    """This rank's (a2a group, p2p group): CP rank o * a + i is rank i of a2a group o and
    rank o of p2p group i. Every rank creates every group, in the same order."""
    cp = ranks.shape[-2]
    lines = ranks.movedim(-2, -1).reshape(-1, cp).tolist()  # every CP group, in CP-rank order
    me = dist.get_rank()
    mine = [None, None]
    for line in lines:
        blocks = [line[o * a2a_size:(o + 1) * a2a_size] for o in range(cp // a2a_size)]
        columns = [line[i::a2a_size] for i in range(a2a_size)]
        for kind, groups in ((0, blocks), (1, columns)):
            for members in groups:
                group = dist.new_group(members)
                if me in members:
                    mine[kind] = group
    return tuple(mine)


def _group_per_line(ranks: torch.Tensor, members, own_line: Tuple[int, ...]):
    """One new group per pipeline (a line of ``ranks`` along ``pp``) with ``members(line)``;
    returns this rank's. Every rank creates every group, in the same order (torch requires it)."""
    lines = ranks.movedim(0, -1).reshape(-1, ranks.shape[0]).tolist()
    mine = None
    for line in lines:
        group = dist.new_group(members(line))
        if tuple(line) == tuple(own_line):
            mine = group
    return mine


def build_expert_mesh(device_type: str, ranks: torch.Tensor, dp_outer: int, ep: int, etp: int):
    """The expert view of this rank's stage: its ranks as (expert-dp, ep, etp), etp innermost.
    ``ranks``: the world's ranks as (pp, ..., tp), tp innermost (any shape in between); the
    one builder of expert meshes (``build_expert_parallel`` calls it without a parallel state).
    The stage's ranks flatten in (dp, cp, tp) order, so at etp = tp the first two axes are
    its data-parallel ranks with the CP ranks folded in (cp fastest, as ``dp_cp_mesh``): EP
    groups take consecutive (dp, cp) ranks, as Megatron carves them from dp x cp."""

    pp = ranks.shape[0]
    stage = ranks[0].numel()  # dp x cp x tp ranks, tp innermost
    if stage % (ep * etp) or (stage // dp_outer) % (ep * etp):
        return None  # the MoE layout check (expert_parallel.py) names the flags at model build
    if dp_outer > 1:
        shape, names = (dp_outer, stage // dp_outer // (ep * etp), ep), ("expert_outer", "expert_inner", "ep")
    else:
        shape, names = (stage // (ep * etp), ep), ("expert_dp", "ep")
    mesh = DeviceMesh(device_type, ranks.reshape((pp,) + shape + (etp,)), mesh_dim_names=("pp",) + names + ("tp",))
    return mesh[names + ("tp",)]


_STATE: Optional[ParallelState] = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1, dp_outer_size: int = 1,
                              device_type: str = "cpu", *, pipeline_model_parallel_size: int = 1,
                              context_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              expert_model_parallel_size: Optional[int] = None,
                              hierarchical_context_parallel_sizes: Optional[Tuple[int, ...]] = None,
                              expert_tensor_parallel_size: Optional[int] = None) -> ParallelState:
    """Build this process's parallel state (after the default process group exists)."""
    global _STATE
    if _STATE is not None:
        raise RuntimeError("model parallelism is already initialized; call destroy_model_parallel() first.")
    _STATE = build_parallel_state(tensor_model_parallel_size, dp_outer_size, device_type,
                                  pipeline_model_parallel_size=pipeline_model_parallel_size,
                                  context_parallel_size=context_parallel_size,
                                  virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
                                  expert_model_parallel_size=expert_model_parallel_size,
                                  hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
                                  expert_tensor_parallel_size=expert_tensor_parallel_size)
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


def get_context_parallel_group() -> Optional[dist.ProcessGroup]:
    """The CP group, or None when model parallelism is not initialized or CP is 1."""
    return _STATE.cp_group if _STATE is not None else None


def get_context_parallel_world_size() -> int:
    return _STATE.cp_size if _STATE is not None else 1


def get_context_parallel_rank() -> int:
    return _STATE.cp_rank if _STATE is not None else 0


def get_pipeline_model_parallel_world_size() -> int:
    return _STATE.pp_size if _STATE is not None else 1


def get_pipeline_model_parallel_rank() -> int:
    return _STATE.pp_rank if _STATE is not None else 0


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def model_parallel_groups() -> List[dist.ProcessGroup]:
    """The groups over which model pieces differ (TP, PP): a norm over the whole model sums
    its squares over them. Empty without model parallelism."""
    if _STATE is None:
        return []
    return [g for g in (_STATE.tp_group, _STATE.pp_group) if g is not None]
