"""Gradient norm and clipping over gradients that may be sharded DTensors.

The norm equals ``torch.nn.utils.clip_grad_norm_`` applied to an unsharded copy of the
gradients: every rank sums |g|^p over its local shard, the partial sums are all-reduced
over the mesh dimensions on which the gradient is *sharded* (never over replicated
dimensions, which would count the same elements twice), and plain tensors (DDP or a
single rank) are identical on every rank, so they are not reduced at all. Then, axis by
axis (the one implementation: the trainer, the MoE layers and the engine's
``clip_grad_norm_`` all come here):

* tensor parallelism: the pieces of TP-split parameters add up over the TP group;
* expert parallelism: the experts' gradients differ across the EP group, so their squared
  norm adds up over it too (2-norm);
* the pipeline: each stage holds other parameters, so the stages' squared norms add up
  over the pipeline group (2-norm); every stage then clips with the same coefficient.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Union

import torch
import torch.distributed as dist

from megatron.core.distributed.comm_device import comm_device

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch always has it in the pinned version
    DTensor = None

Params = Union[torch.Tensor, Iterable[torch.Tensor]]


def _grads_of(parameters: Params) -> List[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [p.grad for p in parameters if p.grad is not None]


def _is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _group_key(grad):
    placements = grad.placements
    if any(p.is_partial() for p in placements):
        raise RuntimeError(
            "a gradient is still Partial (not yet reduced); compute the norm after the "
            "backward pass has finished (after the schedule returns), not inside it."
        )
    shard_dims = tuple(i for i, p in enumerate(placements) if p.is_shard())
    return grad.device_mesh, shard_dims


def get_grad_norm(parameters: Params, norm_type: float = 2.0, tensor_parallel_params=(), tp_group=None,
                  expert_params=(), ep_group=None, pp_group=None, expert_tensor_parallel_params=(),
                  expert_tp_group=None) -> torch.Tensor:
    """Global ``norm_type`` norm of the gradients of ``parameters`` (fp32 scalar tensor, fp64
    for fp64 gradients). With tensor parallelism, ``tensor_parallel_params`` are the
    parameters split over ``tp_group`` (their pieces add up over TP); every other one is
    the same on every TP rank and counted once. ``expert_params`` (a subset of
    ``parameters``) differ across ``ep_group``; ``pp_group`` is the pipeline whose stages
    hold the other parameters (each counted once by the caller: the tied embedding's
    second copy left out). The EP and PP axes need the 2-norm. Experts split over a TP
    group of their own (``--expert-tensor-parallel-size`` apart from TP) name it in
    ``expert_tp_group``, their split parameters in ``expert_tensor_parallel_params``."""
    return _norm(_listed(parameters), lambda p: p.grad, norm_type, tensor_parallel_params, tp_group,
                 expert_params, ep_group, pp_group, _expert_tp(expert_tensor_parallel_params, expert_tp_group))


def get_params_norm(parameters: Params, norm_type: float = 2.0, tensor_parallel_params=(), tp_group=None,
                    expert_params=(), ep_group=None, pp_group=None, expert_tensor_parallel_params=(),
                    expert_tp_group=None) -> torch.Tensor:
    """Global norm of the parameters themselves (Megatron's ``--log-params-norm``), over the
    same axes as :func:`get_grad_norm`."""
    return _norm(_listed(parameters), lambda p: p.detach(), norm_type, tensor_parallel_params, tp_group,
                 expert_params, ep_group, pp_group, _expert_tp(expert_tensor_parallel_params, expert_tp_group))


def _expert_tp(params, group):
    """The experts' own (TP-split parameters, TP group), or None: they split like the dense layers."""
    return None if group is None else (list(params), group)


def _listed(parameters: Params) -> list:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _spans(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def _sum_over(value: torch.Tensor, group) -> torch.Tensor:
    """``value`` (a scalar) summed over ``group``, on the CPU."""
    value = value.reshape(()).to(comm_device(group))
    dist.all_reduce(value, group=group)
    return value.cpu()


def _two_norm_only(norm_type, axis: str) -> None:
    if float(norm_type) != 2.0:
        raise NotImplementedError(f"the gradient norm over the {axis} axis supports the 2-norm only, not {norm_type}.")


def _norm(params, value_of, norm_type, tensor_parallel_params, tp_group, expert_params, ep_group,
          pp_group, expert_tp=None) -> torch.Tensor:
    if _spans(ep_group) or expert_tp is not None:
        _two_norm_only(norm_type, "expert-parallel")
        expert_ids = {id(p) for p in expert_params}
        dense = [p for p in params if id(p) not in expert_ids]
        expert = [p for p in params if id(p) in expert_ids]
        dense_sq = _tensor_parallel_norm(dense, value_of, norm_type, tensor_parallel_params, tp_group).double().cpu() ** 2
        expert_norm = _tensor_parallel_norm(expert, value_of, norm_type,
                                            *(expert_tp or (tensor_parallel_params, tp_group)))
        # Already reduced over the expert-data-parallel mesh (and TP for TP pieces).
        expert_sq = (expert_norm ** 2).double()
        expert_sq = _sum_over(expert_sq, ep_group) if _spans(ep_group) else expert_sq.cpu()
        norm = torch.sqrt(dense_sq + expert_sq).float()
    else:
        norm = _tensor_parallel_norm(params, value_of, norm_type, tensor_parallel_params, tp_group)
    if _spans(pp_group):
        _two_norm_only(norm_type, "pipeline")
        norm = _sum_over(norm.double() ** 2, pp_group).sqrt().float()
    return norm


def _tensor_parallel_norm(params, value_of, norm_type, tensor_parallel_params, tp_group) -> torch.Tensor:
    values = [(p, value_of(p)) for p in params]
    values = [(p, v) for p, v in values if v is not None]
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return _global_norm([v for _, v in values], norm_type)
    split_ids = {id(p) for p in tensor_parallel_params}
    split = _global_norm([v for p, v in values if id(p) in split_ids], norm_type)
    replicated = _global_norm([v for p, v in values if id(p) not in split_ids], norm_type)
    if math.isinf(float(norm_type)):
        dist.all_reduce(split, op=dist.ReduceOp.MAX, group=tp_group)
        return torch.maximum(split, replicated.to(split.device))
    power = split.pow(float(norm_type))
    dist.all_reduce(power, group=tp_group)
    return (power + replicated.to(power.device).pow(float(norm_type))).pow(1.0 / float(norm_type))


def count_zeros(parameters: Params, tensor_parallel_params=(), tp_group=None, expert_params=(), ep_group=None,
                pp_group=None, expert_tensor_parallel_params=(), expert_tp_group=None) -> int:
    """Number of zero entries in the gradients, over the whole model (``--log-num-zeros-in-grad``).
    Plain gradients are whole on every rank; sharded ones add up over their shard dims, the
    pieces of ``tensor_parallel_params`` over ``tp_group``, the experts' over ``ep_group``
    and the stages' over ``pp_group`` (the axes of :func:`get_grad_norm`)."""
    parameters = _listed(parameters)
    expert_tp = _expert_tp(expert_tensor_parallel_params, expert_tp_group)
    if _spans(ep_group) or expert_tp is not None:
        expert_ids = {id(p) for p in expert_params}
        dense = [p for p in parameters if id(p) not in expert_ids]
        expert = float(_count_zeros_tp([p for p in parameters if id(p) in expert_ids],
                                       *(expert_tp or (tensor_parallel_params, tp_group))))
        if _spans(ep_group):
            expert = float(_sum_over(torch.tensor(expert).double(), ep_group))
        zeros = _count_zeros_tp(dense, tensor_parallel_params, tp_group) + int(expert)
    else:
        zeros = _count_zeros_tp(parameters, tensor_parallel_params, tp_group)
    if _spans(pp_group):
        return int(_sum_over(torch.tensor(float(zeros), dtype=torch.float64), pp_group))
    return zeros


def _count_zeros_tp(parameters, tensor_parallel_params, tp_group) -> int:
    if _spans(tp_group):
        split_ids = {id(p) for p in tensor_parallel_params}
        split = _count_zeros([p for p in parameters if id(p) in split_ids])
        part = torch.tensor([float(split)], dtype=torch.float64, device=comm_device(tp_group))
        dist.all_reduce(part, group=tp_group)
        return int(part.item()) + _count_zeros([p for p in parameters if id(p) not in split_ids])
    return _count_zeros(parameters)


def _count_zeros(parameters) -> int:
    def zeros(t: torch.Tensor) -> int:
        return int((t == 0).sum()) if t.numel() else 0

    total = 0
    by_group: dict = {}  # insertion-ordered: every rank reduces in the same order
    for g in _grads_of(parameters):
        if _is_dtensor(g):
            key = _group_key(g)
            by_group[key] = by_group.get(key, 0) + zeros(g.to_local())
        else:
            total += zeros(g)
    for (mesh, shard_dims), count in by_group.items():
        part = torch.tensor([float(count)], dtype=torch.float64, device=comm_device(mesh.get_group(shard_dims[0]))
                            if shard_dims else torch.device("cpu"))
        for dim in shard_dims:
            dist.all_reduce(part, group=mesh.get_group(dim))
        total += int(part.item())
    return total


def _global_norm(grads: List[torch.Tensor], norm_type: float) -> torch.Tensor:
    norm_type = float(norm_type)
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    device = grads[0].to_local().device if _is_dtensor(grads[0]) else grads[0].device
    is_inf = math.isinf(norm_type)
    # fp32 at least (bf16 sums lose too much); fp64 if the gradients themselves are fp64.
    acc_dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32

    def local_reduce(tensors: List[torch.Tensor]) -> torch.Tensor:
        # Uneven sharding can leave a rank with an empty shard (inf norm is undefined on it).
        tensors = [t for t in tensors if t.numel() > 0]
        if not tensors:
            return torch.zeros((), dtype=acc_dtype, device=device)
        norms = torch.stack(
            [torch.linalg.vector_norm(t.detach().to(acc_dtype), norm_type).to(device) for t in tensors]
        )
        return norms.max() if is_inf else norms.pow(norm_type).sum()

    plain: List[torch.Tensor] = []
    # Insertion-ordered so that every rank issues the same collectives in the same order.
    sharded: dict = {}
    for g in grads:
        if _is_dtensor(g):
            sharded.setdefault(_group_key(g), []).append(g.to_local())
        else:
            plain.append(g)

    total = local_reduce(plain)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    for (mesh, shard_dims), locals_ in sharded.items():
        part = local_reduce(locals_)
        for dim in shard_dims:
            dist.all_reduce(part, op=op, group=mesh.get_group(dim))
        total = torch.maximum(total, part) if is_inf else total + part
    return total if is_inf else total.pow(1.0 / norm_type)


def clip_grad_norm(parameters: Params, max_norm: float, norm_type: float = 2.0, tensor_parallel_params=(),
                   tp_group=None, expert_params=(), ep_group=None, pp_group=None, expert_tensor_parallel_params=(),
                   expert_tp_group=None) -> torch.Tensor:
    """Scale gradients in place so their global norm (:func:`get_grad_norm`, over the same
    axes) is at most ``max_norm``.

    Returns the norm *before* clipping, like ``torch.nn.utils.clip_grad_norm_``.
    ``max_norm <= 0`` only measures the norm. A non-finite norm leaves the gradients
    untouched (the trainer skips that step instead of writing NaNs into them).
    """
    parameters = _listed(parameters)
    total_norm = get_grad_norm(parameters, norm_type, tensor_parallel_params, tp_group, expert_params, ep_group,
                               pp_group, expert_tensor_parallel_params, expert_tp_group)
    clip_grads_to(parameters, total_norm, max_norm)
    return total_norm


def clip_grads_to(parameters: Params, total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale the gradients in place, given their global norm ``total_norm``, so that it
    becomes at most ``max_norm`` (no-op for ``max_norm <= 0`` or a non-finite norm)."""
    if max_norm <= 0 or not torch.isfinite(total_norm):
        return
    # Same coefficient as torch.nn.utils.clip_grad_norm_ (including its 1e-6).
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in _grads_of(parameters):
        local = g.to_local() if _is_dtensor(g) else g
        local.mul_(clip_coef.to(device=local.device, dtype=local.dtype))
