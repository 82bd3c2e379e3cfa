"""The expert-parallel layout: which ranks share their tokens, which hold the same experts.

As in Megatron-LM, the EP ranks are contiguous (the inner dimension) within the
data-parallel world of W ranks: with EP size P, ranks ``[g * P, (g + 1) * P)`` form an
expert-parallel group (they exchange tokens; EP rank r holds experts ``[r * E/P, (r+1) * E/P)``),
and ranks ``{r, r + P, r + 2P, ...}`` form an expert-data-parallel group of size W / P (they
hold the same experts and average their gradients). Both come from one 2-D device mesh
``("expert_dp", "ep")`` of shape ``(W / P, P)``; MFSDP shards the experts over its
``expert_dp`` dimension with ``grad_divisor = P``.

Why the divisor: every rank's loss is averaged over the W data-parallel ranks, and an
expert's gradient on rank r already sums the contributions of the tokens of all P ranks of
its EP group (the all-to-all's backward brings them back). Averaging over the W / P ranks
that hold the expert then divides by W / P only; the remaining factor P is ``grad_divisor``.

With tensor parallelism of size T (the world is ``(dp, tp)``, TP innermost,
``megatron/core/parallel_state.py``) the same holds per TP coordinate, as in Megatron with
the expert tensor-parallel size equal to T: the mesh is ``("expert_dp", "ep", "tp")`` of
shape ``(W / P, P, T)`` over the same ranks (W the data-parallel size, so data-parallel
rank ``d = e * P + r`` of TP rank ``t`` is world rank ``d * T + t``). The ranks that
exchange tokens have the same TP rank and form one EP group; every expert is split over
the TP group (``experts.py``); the expert-data-parallel ranks hold the same experts and
the same TP piece of them. The divisor stays P.

Under HSDP/HFSDP (``--num-distributed-optimizer-instances`` O > 1) the dense units are
sharded over the 2-D mesh ``("outer", "inner")`` of shape ``(O, I)``, ``I = W / O`` (one
instance = I consecutive data-parallel ranks). The expert-data-parallel ranks get the same
two levels: the mesh is ``("expert_outer", "expert_inner", "ep"[, "tp"])`` of shape
``(O, I / P, P[, T])``. Data-parallel rank ``d = o * I + i`` is then ``expert_outer`` o
(the same instance, so the outer replica groups are the dense ones restricted to the
ranks holding the same experts), ``expert_inner`` ``i // P`` and EP rank ``i % P``: every
EP group lies inside one instance. That needs P to divide I, which is the same as O
dividing the expert-data-parallel size W / P; other sizes are refused. The experts are
sharded over ``("expert_outer", "expert_inner")`` with the run's HSDP/HFSDP placements
and ``grad_divisor = P``: the two levels average over O * I / P = W / P ranks, as the
1-D mesh does.

Under context parallelism of size C every CP rank routes its own tokens, so the CP ranks
count as data-parallel ranks here (W = DP x C, CP fastest, as the engine's ``dp_cp_mesh``
folds them): an EP group is P consecutive such ranks, e.g. the two CP ranks of one
data-parallel rank at C = P = 2. The loss of every rank is averaged over the W ranks
(the trainer scales it by C), so the divisor stays P. ``megatron/core/parallel_state.py``
builds that view.

Expert tensor parallelism apart from TP (``--expert-tensor-parallel-size`` ETP != T, as
large MoE runs use, often ETP = 1): the mesh's ``tp`` axis has size ETP, and the mesh
cuts one pipeline stage's ``W * T`` ranks as ``(W * T / (P * ETP), P, ETP)`` with ETP
innermost, then EP, then expert-dp, upstream's expert rank order. An EP group may then
span dense TP ranks (T = 2, ETP = 1, P = 2: the EP groups are the TP groups). The
tokens are made distinct per rank first (``moe_layer.py``), so every rank of the stage
routes its own ones and an expert's gradient on a rank sums the tokens of the P * ETP
ranks of its (ep, tp) block, which hold P * ETP / T data-parallel ranks' worth of data;
averaging over the W * T / (P * ETP) expert-data-parallel ranks leaves the divisor
``P * ETP / T`` (``grad_divisor``; P at ETP = T, possibly below 1). The router's token
statistics are summed over the dense data-parallel group (``token_groups``), since the
mesh's other axes now mix TP ranks.

This module decides the expert layout (sizes, checks, ``ExpertParallel``); the mesh itself
always comes from ``parallel_state.build_expert_mesh``, the one builder of expert meshes: the run's
parallel state carves it from its rank tensor, and without one ``build_expert_parallel``
hands it the world as one stage (TP innermost and the instances outermost in both, so their
TP groups and instances agree). The model queries (which layers are MoE, which parameters are
experts) live in ``model_queries.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """``size`` and ``rank`` of this rank in its expert-parallel group; ``group`` (None when
    size is 1); ``mesh``: the ``("expert_dp", "ep"[, "tp"])`` device mesh, or
    ``("expert_outer", "expert_inner", "ep"[, "tp"])`` under HSDP/HFSDP (None without a process group)."""

    size: int = 1
    rank: int = 0
    group: Any = None
    mesh: Any = None
    # With the expert TP size apart from the TP size: the groups over which the router sums
    # token statistics (the dense data-parallel group); None: the mesh's axes other than tp.
    token_groups: Optional[Tuple[Any, ...]] = None
    dense_tp_size: Optional[int] = None  # the model's TP size when it differs from tp_size

    @property
    def tensor_parallel_apart(self) -> bool:
        """Whether the experts' TP axis (``tp_size``) is not the dense layers' TP group."""
        return self.dense_tp_size is not None

    @property
    def tp_group(self):
        """The expert tensor-parallel group (None at size 1)."""
        return self.mesh.get_group("tp") if self.tp_size > 1 else None

    @property
    def grad_divisor(self) -> float:
        """What MFSDP divides the experts' gradients by beyond the expert-dp average (module docstring)."""
        return self.size * self.tp_size / self.dense_tp_size if self.tensor_parallel_apart else self.size

    @property
    def expert_dp_dims(self) -> Tuple[str, ...]:
        """The mesh dimensions of the expert-data-parallel ranks: ``("expert_dp",)``, or
        ``("expert_outer", "expert_inner")`` under HSDP/HFSDP (those before ``ep``)."""
        if self.mesh is None:
            raise RuntimeError("this ExpertParallel has no device mesh; build it with build_expert_parallel().")
        names = self.mesh.mesh_dim_names
        return tuple(names[:names.index("ep")])

    @property
    def outer_size(self) -> int:
        """The number of distributed-optimizer instances the mesh was built for (1 without one)."""
        return _outer_size_of(self.mesh)

    @property
    def tp_size(self) -> int:
        """The TP size the mesh was built for (its innermost ``tp`` dimension, else 1)."""
        if self.mesh is None or "tp" not in self.mesh.mesh_dim_names:
            return 1
        return self.mesh.size(self.mesh.mesh_dim_names.index("tp"))

    @property
    def expert_dp_mesh(self):
        """The mesh of the ranks that hold the same experts (MFSDP shards experts over it):
        1-D, or 2-D under HSDP/HFSDP."""
        dims = self.expert_dp_dims
        return self.mesh[dims[0]] if len(dims) == 1 else self.mesh[dims]

    def local_experts(self, num_experts: int) -> range:
        """Global indices of the experts this rank holds."""
        local = num_experts // self.size
        return range(self.rank * local, (self.rank + 1) * local)


def _outer_size_of(mesh) -> int:
    if mesh is None or "expert_outer" not in mesh.mesh_dim_names:
        return 1
    return mesh.size(0)


def check_expert_parallel_size(ep_size: int, dp_size: int, tp_size: int = 1, dp_outer_size: int = 1,
                               cp_size: int = 1) -> None:
    """EP groups lie inside the ``dp_size`` data-parallel ranks (of one TP coordinate; under
    context parallelism ``dp_size`` counts the data-parallel x CP ranks, ``cp_size`` of
    them per data-parallel rank), and under HSDP/HFSDP inside one of the ``dp_outer_size``
    instances."""
    if ep_size < 1 or dp_size % ep_size:
        if cp_size > 1:
            size = f"{dp_size} = data-parallel size {dp_size // cp_size} x --context-parallel-size {cp_size}"
            hint = "."
        else:
            size = f"{dp_size} = world size {dp_size * tp_size} / tensor-parallel size {tp_size}" if tp_size > 1 \
                else dp_size
            hint = " or a smaller --tensor-model-parallel-size." if tp_size > 1 else "."
        raise ValueError(
            f"--expert-model-parallel-size ({ep_size}) must divide the data-parallel size ({size}); "
            f"use a divisor of {dp_size}" + hint
        )
    inner = dp_size // dp_outer_size
    if dp_outer_size > 1 and inner % ep_size:
        raise ValueError(
            f"--expert-model-parallel-size ({ep_size}) must divide the ranks of one HSDP/HFSDP instance "
            f"({inner} = data-parallel size {dp_size}{' (x CP)' if cp_size > 1 else ''} / "
            f"--num-distributed-optimizer-instances {dp_outer_size}), "
            f"so that the experts get a 2-D expert-data-parallel mesh; use a divisor of {inner} or fewer instances."
        )


def build_expert_parallel(ep_size: int, device_type: str, tp_size: int = 1, dp_outer_size: int = 1,
                          expert_tp_size: Optional[int] = None) -> ExpertParallel:
    """The layout for EP size ``ep_size`` over the default process group, with TP size
    ``tp_size`` innermost and ``dp_outer_size`` HSDP/HFSDP instances outermost (every rank
    calls it). Without an initialized process group only sizes 1 exist (a single process).
    ``expert_tp_size`` other than ``tp_size`` takes the run's parallel state's expert view
    (``parallel_state.initialize_model_parallel(..., expert_tensor_parallel_size=)``)."""
    etp = tp_size if expert_tp_size is None else int(expert_tp_size)
    if not dist.is_initialized():
        if ep_size != 1 or tp_size != 1 or dp_outer_size != 1 or etp != 1:
            raise ValueError(f"expert parallelism of size {ep_size} with TP size {tp_size} and {dp_outer_size} "
                             "instances needs torch.distributed (launch with torchrun).")
        return ExpertParallel()
    if parallel_state.model_parallel_is_initialized():
        # The run's one mesh: the expert view of this rank's pipeline stage.
        state = parallel_state.get_parallel_state()
        if state.expert_mesh is not None and (state.ep_size, state.tp_size, state.etp_size) == \
                (ep_size, tp_size, etp) and _outer_size_of(state.expert_mesh) == dp_outer_size:
            mesh = state.expert_mesh
            apart = {}
            if etp != tp_size:
                apart = dict(token_groups=(state.dp_group,) if state.dp_size > 1 else (), dense_tp_size=tp_size)
            return ExpertParallel(size=ep_size, rank=mesh.get_local_rank("ep"),
                                  group=mesh.get_group("ep") if ep_size > 1 else None, mesh=mesh, **apart)
        if state.pp_size > 1 or state.cp_size > 1 or etp != tp_size:
            # the world alone would not say which ranks split a stage (or a CP group)
            raise ValueError(f"the run's parallel state has no expert view for EP size {ep_size} and expert TP size "
                             f"{etp}; initialize it with initialize_model_parallel(..., expert_model_parallel_size="
                             f"{ep_size}, expert_tensor_parallel_size={etp}).")
    if etp != tp_size:
        raise ValueError(f"an expert TP size ({etp}) other than the TP size ({tp_size}) needs the run's parallel "
                         f"state; call initialize_model_parallel(..., expert_tensor_parallel_size={etp}) first.")
    world = dist.get_world_size()
    if tp_size < 1 or dp_outer_size < 1 or world % (tp_size * dp_outer_size):
        raise ValueError(f"the TP size ({tp_size}) x the instances ({dp_outer_size}) must divide the world size "
                         f"({world}).")
    dp = world // tp_size
    check_expert_parallel_size(ep_size, dp, tp_size, dp_outer_size)
    # No parallel state: the world is one stage of (dp, tp) ranks; the same builder as the state's view.
    mesh = parallel_state.build_expert_mesh(device_type, torch.arange(world).reshape(1, world), dp_outer_size, ep_size,
                                      tp_size)
    group = mesh.get_group("ep") if ep_size > 1 else None
    return ExpertParallel(size=ep_size, rank=mesh.get_local_rank("ep"), group=group, mesh=mesh)
