"""The fused linear (tensor_parallel/grad_accumulation_fusion.py) against ``F.linear``:
the same output and gradients bit for bit, strides included, with the weight gradient
landing in the buffer the weight's ``fused_wgrad_out`` offers; the fused embedding against
``F.embedding``, its touched rows handed to ``add_to_fused_wgrad`` when that accepts them."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.grad_accumulation_fusion import embedding, linear
from megatron.core.transformer.layers import Embedding

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accept", [False, True])
def test_fused_embedding_is_f_embedding_bit_for_bit(dtype, accept):
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(40, 8, generator=g).to(dtype)
    # Repeated ids (rows summed in the backward) and rows no id touches.
    ids = torch.randint(0, 40, (4, 9), generator=g)
    grad_out = torch.randn(4, 9, 8, generator=g).to(dtype)
    plain_w = torch.nn.Parameter(w0.clone())
    plain_out = F.embedding(ids, plain_w)
    plain_out.backward(grad_out)
    taken = []
    w = torch.nn.Parameter(w0.clone())
    w.add_to_fused_wgrad = lambda touched_rows: accept and (taken.append(touched_rows()) or True)
    out = embedding(ids, w)
    assert type(out.grad_fn).__name__ == "_EmbeddingWithFusedWgradBackward"
    out.backward(grad_out)
    assert torch.equal(out, plain_out)
    if accept:
        assert w.grad is None and len(taken) == 1
        rows, values = taken[0]
        assert rows.tolist() == sorted(set(ids.flatten().tolist())), "rows: the distinct ids, each once"
        assert torch.equal(values, plain_w.grad[rows])
        untouched = torch.ones(40, dtype=torch.bool)
        untouched[rows] = False
        assert not plain_w.grad[untouched].any(), "the rows left out must be the zero ones"
    else:
        assert torch.equal(w.grad, plain_w.grad) and not taken


def test_tied_weight_gradients_meet_in_the_slot_bit_for_bit():
    """An output layer tied to the embedding: its fused gradient in the slot plus the
    embedding's, added there, equal autograd's sum of the two."""
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(40, 8, generator=g)
    ids = torch.randint(0, 40, (5, 7), generator=g)  # some rows untouched: the slot keeps them

    def loss_of(w, fused):
        h = torch.tanh((embedding if fused else F.embedding)(ids, w))
        return (linear if fused else F.linear)(h, w).square().mean()

    plain_w = torch.nn.Parameter(w0.clone())
    loss_of(plain_w, False).backward()
    slot = torch.full((w0.numel(),), float("nan"))
    added = []
    w = torch.nn.Parameter(w0.clone())
    w.fused_wgrad_out = lambda: slot.view_as(w0)
    w.add_to_fused_wgrad = lambda touched_rows: added.append(touched_rows()) or True
    loss_of(w, True).backward()
    assert w.grad.data_ptr() == slot.data_ptr() and len(added) == 1
    slot.view_as(w0).index_add_(0, *added[0])  # what the engine does when the slot is delivered
    assert torch.equal(slot.view_as(w0), plain_w.grad)


def test_embedding_layer_keeps_nn_embedding_options():
    """Options the fused backward does not mirror (padding index, max norm, frequency
    scaling, sparse) use nn.Embedding's own forward."""
    layer = Embedding(6, 4, init_std=0.1)
    layer.weight.add_to_fused_wgrad = lambda touched_rows: True
    assert type(layer(torch.tensor([1, 2])).grad_fn).__name__ == "_EmbeddingWithFusedWgradBackward"
    layer.padding_idx = 0
    assert type(layer(torch.tensor([1, 2])).grad_fn).__name__ == "EmbeddingBackward0"
    unfused = Embedding(6, 4, init_std=0.1, gradient_accumulation_fusion=False)
    unfused.weight.add_to_fused_wgrad = lambda touched_rows: True
    assert type(unfused(torch.tensor([1, 2])).grad_fn).__name__ == "EmbeddingBackward0"
