"""Autograd-aware collectives at the boundaries of tensor-parallel regions.

Megatron-LM's names and semantics, for batch-first activations (``[b, s, h]``): the
sequence-parallel split is along dim 1 (``s``), the tensor-parallel split of features
along the last dim. Each function is the identity at TP size 1 (``group`` None or of
size 1). Forward / backward:

=========================================  ======================  ======================
copy_to_tensor_model_parallel_region       identity                all-reduce
reduce_from_tensor_model_parallel_region   all-reduce              identity
gather_from_tensor_model_parallel_region   all-gather (last dim)   split (last dim)
scatter_to_sequence_parallel_region        split (seq)             all-gather (seq)
gather_from_sequence_parallel_region       all-gather (seq)        reduce-scatter (seq)
  (tensor_parallel_output_grad=False)      all-gather (seq)        split (seq)
reduce_scatter_to_sequence_parallel_region reduce-scatter (seq)    all-gather (seq)
=========================================  ======================  ======================

Every collective goes through ``_all_reduce`` / ``_all_gather`` / ``_reduce_scatter``;
gathers and reduce-scatters move a contiguous ``[tp, ...]`` block (what NCCL wants and
gloo needs: flat buffers).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

SEQUENCE_DIM = 1  # batch-first activations


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    size = _size(group)
    stacked = torch.empty((size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    dist.all_gather_single(stacked.view(-1), x.contiguous().view(-1), group=group)
    # [tp, ..., n, ...] -> [..., tp * n, ...]
    return stacked.movedim(0, dim).flatten(dim, dim + 1)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's equal piece of ``x`` along ``dim``."""
    size = _size(group)
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {size} tensor-parallel ranks; "
                         "make it a multiple of --tensor-model-parallel-size.")
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum over ranks, then this rank's piece along ``dim``."""
    size = _size(group)
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {size} tensor-parallel ranks; "
                         "make it a multiple of --tensor-model-parallel-size.")
    # [..., tp * n, ...] -> [tp, ..., n, ...], contiguous: rank r's piece is block r.
    blocks = x.unflatten(dim, (size, x.shape[dim] // size)).movedim(dim, 0).contiguous()
    out = torch.empty(blocks.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out.view(-1), blocks.view(-1), group=group)
    return out


def _identity(x: torch.Tensor, group) -> torch.Tensor:
    return x


def _region(name: str, forward, backward):
    """The mapping ``name(x, group)``: ``forward(x, group)`` forward, ``backward(grad, group)``
    backward; the identity at TP size 1."""

    class Region(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad, ctx.group), None

    def mapping(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        return x if _size(group) == 1 else Region.apply(x, group)

    Region.__name__ = Region.__qualname__ = f"_{name}"
    mapping.__name__ = mapping.__qualname__ = name
    return mapping


def _last(function):
    return lambda x, group: function(x, x.dim() - 1, group)


def _sequence(function):
    return lambda x, group: function(x, SEQUENCE_DIM, group)


# The table of the module docstring. The input of an all-reduce is cloned: autograd may
# still need it. A gather_from_sequence_parallel_region feeds a column-parallel layer,
# which saw the whole sequence on every rank and produced partial gradients: backward
# sums them and keeps this rank's chunk.
copy_to_tensor_model_parallel_region = _region("copy_to_tensor_model_parallel_region", _identity, _all_reduce)
reduce_from_tensor_model_parallel_region = _region(
    "reduce_from_tensor_model_parallel_region", lambda x, group: _all_reduce(x.clone(), group), _identity)
gather_from_tensor_model_parallel_region = _region(
    "gather_from_tensor_model_parallel_region", _last(_all_gather), _last(_split))
scatter_to_sequence_parallel_region = _region(
    "scatter_to_sequence_parallel_region", _sequence(_split), _sequence(_all_gather))
_gather_from_sequence_parallel_region = _region(
    "gather_from_sequence_parallel_region", _sequence(_all_gather), _sequence(_reduce_scatter))
# Megatron's tensor_parallel_output_grad=False: the gathered tensor's gradient is the same
# on every rank (a TP-replicated region follows), so backward keeps this rank's chunk.
_gather_from_sequence_parallel_region_replicated_grad = _region(
    "gather_from_sequence_parallel_region", _sequence(_all_gather), _sequence(_split))


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Optional[dist.ProcessGroup],
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    if tensor_parallel_output_grad:
        return _gather_from_sequence_parallel_region(x, group)
    return _gather_from_sequence_parallel_region_replicated_grad(x, group)
reduce_scatter_to_sequence_parallel_region = _region(
    "reduce_scatter_to_sequence_parallel_region", _sequence(_reduce_scatter), _sequence(_all_gather))
