"""Gradient-accumulation fusion: a linear layer's weight gradient computed straight into the
buffer that reduces it.

Megatron-LM's ``--gradient-accumulation-fusion`` (on unless ``--no-gradient-accumulation-fusion``)
has the linear backward write ``dW`` into ``weight.main_grad`` with a fused GEMM instead of
producing a fresh ``.grad`` that is copied there afterwards. Here the same idea needs no
special kernel: a weight whose data-parallel wrapper offers a place for its gradient carries
a callable ``weight.fused_wgrad_out()`` (MFSDP v2 sets it on every unsharded parameter it
shards gradients for). The backward asks it for a tensor, runs the one GEMM it would run
anyway with that tensor as ``out=``, and returns the tensor to autograd, which keeps it as
``.grad`` without a copy; the wrapper's gradient hook recognizes it. When the callable
answers None (a second gradient of the same weight in one backward, dtypes that differ, a
weight the shard padding splits) the backward is autograd's own.

The backward computes exactly what autograd computes for ``F.linear`` (the same GEMMs on the
same operands, the bias gradient as the same sum), so fused and unfused runs agree bit for bit.

Tied embeddings: the output layer's fused backward has already written its gradient of the
shared weight into the slot when the embedding's backward runs. Autograd would build the
embedding's gradient as a zero-filled vocabulary-sized tensor, sum it with the slot into a
second one, which the wrapper then copies into the slot. Instead the embedding's backward
offers ``weight.add_to_fused_wgrad`` (set by MFSDP v2 next to ``fused_wgrad_out``) a
function that sums the gradient of the rows the batch touches only (the same kernel on
renumbered ids, so each row is summed in the same order); once accepted, the wrapper adds
those rows into the slot when the slot's gradient is delivered, and autograd gets no
gradient from the embedding. Each touched row gets the same one addition as before,
so the result is the same bit for bit, except that an exact ``-0.0`` of the output layer's
gradient in an untouched row stays ``-0.0`` (adding autograd's ``+0.0`` turned it into
``+0.0``). When the callable declines (no slot held by this backward) the full gradient
goes to autograd as usual.
"""

from typing import Optional

import torch
import torch.nn.functional as F


class _LinearWithFusedWgrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        # Kept here: under activation recompute the saved weight comes back as another tensor.
        ctx.fused_wgrad_out = weight.fused_wgrad_out
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        x_2d = x.reshape(-1, x.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            if x_2d.stride(0) == 1 and x_2d.stride(1) == x_2d.size(0):
                # A column-major input gets a column-major gradient (autograd's mm rule).
                grad_x = weight.t().mm(grad_2d.t()).t()
            else:
                grad_x = grad_2d.mm(weight)
            grad_x = grad_x.view(x.shape) if x.dim() != 2 else grad_x
        if ctx.needs_input_grad[1]:
            # create_graph needs autograd's own differentiable result, not a buffer.
            out = None if torch.is_grad_enabled() else ctx.fused_wgrad_out()
            grad_w = torch.mm(grad_2d.t(), x_2d, out=out) if out is not None else grad_2d.t().mm(x_2d)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_2d.sum(0)
        return grad_x, grad_w, grad_b


class _EmbeddingWithFusedWgrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        # The backward needs no weight values: only its row count and where its gradient goes.
        ctx.num_weights = weight.shape[0]
        ctx.add_to_fused_wgrad = weight.add_to_fused_wgrad
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (ids,) = ctx.saved_tensors
        # create_graph needs the gradient in the graph, not added out of band.
        if not torch.is_grad_enabled() and ctx.add_to_fused_wgrad(lambda: _touched_rows(grad_output, ids)):
            return None, None
        # What autograd's EmbeddingBackward0 computes for F.embedding's defaults (no padding
        # index, no frequency scaling, dense).
        return None, torch.ops.aten.embedding_backward(grad_output, ids, ctx.num_weights, -1, False, False)


def _touched_rows(grad_output: torch.Tensor, ids: torch.Tensor):
    """(rows, values): the embedding's weight gradient on the distinct ``ids`` only, each
    row summed by autograd's own kernel in the same order as over the full table."""
    rows, renumbered = torch.unique(ids, return_inverse=True)
    return rows, torch.ops.aten.embedding_backward(grad_output, renumbered, rows.numel(), -1, False, False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           fusion: bool = True) -> torch.Tensor:
    """``F.linear``, with the weight gradient fused into its reduction buffer when ``fusion``
    is on and the weight offers one (``fused_wgrad_out``); plain ``F.linear`` otherwise."""
    if (not fusion or not weight.requires_grad or getattr(weight, "fused_wgrad_out", None) is None
            or not weight.is_contiguous() or x.dim() < 2  # the layouts whose rules the backward mirrors
            or not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type)
            # Inside a compiled layer (--compile-layers): the graph cannot write into the
            # engine's buffer from its backward; autograd's gradient goes there by the hook.
            or torch.compiler.is_compiling()):
        return F.linear(x, weight, bias)
    return _LinearWithFusedWgrad.apply(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor, fusion: bool = True) -> torch.Tensor:
    """``F.embedding`` with its defaults; with ``fusion`` on and a weight that offers it
    (``add_to_fused_wgrad``: a tied output layer's fused slot), the gradient of the rows the
    batch touches is added into that slot instead of being summed by autograd."""
    if (not fusion or not weight.requires_grad or getattr(weight, "add_to_fused_wgrad", None) is None
            or not torch.is_grad_enabled()):
        return F.embedding(ids, weight)
    return _EmbeddingWithFusedWgrad.apply(ids, weight)
