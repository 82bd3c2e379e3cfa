"""Gradients of a tensor-parallel model before the optimizer step (Megatron's
``finalize_model_grads``, the tensor-parallel part).

A parameter of a tensor-parallel layer (or one a MoE layer's experts name in
``tensor_parallel_split``) is split over TP: each rank's gradient is that of its own
piece. Every other parameter is replicated over TP. Without sequence parallelism all TP ranks compute the same gradient for it. With
sequence parallelism every replicated parameter of the model is used inside a
sequence-parallel region (norms, row-parallel biases, learned position embeddings, which
look up this rank's positions only, a MoE router, which routes this rank's chunk, and an
expert's fc2 bias, which TP rank 0 alone adds), so each rank holds the gradient of its
sequence chunk, and the gradient is their sum over TP: ``all_reduce_sequence_parallel_grads``.
Experts whose TP group is not the TP group (``--expert-tensor-parallel-size`` apart from
it; their modules say ``tensor_parallel_apart``) are neither: their gradients are whole
for their own layout already (``moe/experts.py``), so the TP sum leaves them out.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

TENSOR_PARALLEL_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def tensor_parallel_parameters(model: nn.Module) -> List[nn.Parameter]:
    """The parameters split over TP (read after wrapping: the module's current ones): those
    of the TP layers, and those another layer names in ``tensor_parallel_split`` (the
    experts of a MoE layer)."""
    out = []
    for module in model.modules():
        if isinstance(module, TENSOR_PARALLEL_LAYERS):
            names = module.global_slices
        else:
            names = getattr(module, "tensor_parallel_split", ())
        out += [module._parameters[a] for a in names if module._parameters.get(a) is not None]
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def all_reduce_sequence_parallel_grads(model: nn.Module, tp_group: Optional[dist.ProcessGroup]) -> None:
    """Sum the gradients of the TP-replicated parameters over TP, in place (one all-reduce).
    Call after the backward of the last microbatch and before clipping."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    split = {id(p) for p in tensor_parallel_parameters(model)}
    split |= {id(p) for m in model.modules() if getattr(m, "tensor_parallel_apart", False) for p in m.parameters()}
    grads = [_local(p.grad) for p in model.parameters() if id(p) not in split and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
