"""The fused linear (tensor_parallel/grad_accumulation_fusion.py) against ``F.linear``:
the same output and gradients bit for bit, strides included, with the weight gradient
landing in the buffer the weight's ``fused_wgrad_out`` offers."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.grad_accumulation_fusion import linear

SHAPES = [(7, 16), (1, 16), (5, 3, 16), (3, 5, 16), (64, 2, 16)]


def _input(base: torch.Tensor, layout: str):
    """(leaf, the tensor fed to the layer) for a row-major, column-major or sliced input."""
    if layout == "column":
        leaf = base.clone().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()
        return leaf, leaf
    if layout == "slice":  # a view into a wider tensor: not contiguous
        leaf = torch.zeros(*base.shape[:-1], 2 * base.shape[-1], dtype=base.dtype)
        leaf[..., : base.shape[-1]] = base
        leaf.requires_grad_()
        return leaf, leaf[..., : base.shape[-1]]
    leaf = base.clone().requires_grad_()
    return leaf, leaf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["row", "column", "slice"])
def test_fused_linear_is_f_linear_bit_for_bit(dtype, shape, bias, layout):
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(*shape, generator=g).to(dtype)
    w0 = torch.randn(24, 16, generator=g).to(dtype)
    b0 = torch.randn(24, generator=g).to(dtype) if bias else None
    grad_out = torch.randn(*shape[:-1], 24, generator=g).to(dtype)
    results = {}
    for fused in (False, True):
        leaf, x = _input(x0, layout)
        w = torch.nn.Parameter(w0.clone())
        b = torch.nn.Parameter(b0.clone()) if bias else None
        buffer = torch.full((3 + w0.numel(),), float("nan"), dtype=dtype)  # offset 3: an unaligned view
        if fused:
            # A fresh view per call, as the engine gives: autograd keeps a gradient as
            # .grad without copying it only when nothing else holds that tensor.
            w.fused_wgrad_out = lambda: buffer[3:].view_as(w0)
        out = (linear if fused else F.linear)(x, w, b)
        out.backward(grad_out)
        results[fused] = [out.detach(), leaf.grad, w.grad] + ([b.grad] if bias else [])
        if fused:
            assert w.grad.data_ptr() == buffer[3:].data_ptr(), "the weight gradient was not written into the buffer"
    for plain, fused in zip(results[False], results[True]):
        assert torch.equal(plain, fused) and plain.stride() == fused.stride()


def test_a_weight_without_a_buffer_uses_f_linear():
    w = torch.nn.Parameter(torch.randn(3, 4))
    x = torch.randn(2, 4, requires_grad=True)
    out = linear(x, w)
    assert type(out.grad_fn).__name__ == "MmBackward0"
    w.fused_wgrad_out = lambda: None  # offered, but nothing to fuse into this time
    out = linear(x, w)
    out.sum().backward()
    assert type(out.grad_fn).__name__ == "_LinearWithFusedWgradBackward"
    torch.testing.assert_close(w.grad, torch.ones(2, 3).t().mm(x.detach()))
    assert type(linear(x, w, fusion=False).grad_fn).__name__ == "MmBackward0"
