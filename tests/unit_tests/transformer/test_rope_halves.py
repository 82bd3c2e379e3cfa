"""RoPE's rotate-half autograd function (rope._RotateHalves) against the composition it
replaces (the same bits, forward and backward), against float64 rotation math, and by
gradcheck; the composition stays for interleaved pairs and for tables that need a gradient."""

import pytest
import torch

from megatron.core.transformer.rope import (RotaryEmbedding, YarnScaling, _RotateHalves, _rotate_composed,
                                            apply_rotary_pos_emb)


def _tables(rotary_dim, seq, yarn=None):
    positions = torch.arange(seq).expand(2, seq)
    return RotaryEmbedding(rotary_dim, rotary_base=500000, yarn=yarn)(positions)


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [32, 16])  # the whole head, and --rotary-percent 0.5
@pytest.mark.parametrize("yarn", [None, YarnScaling(scaling_factor=4.0, original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=0.5)])
def test_same_bits_as_the_composition(dtype, rotary_dim, yarn):
    torch.manual_seed(0)
    heads, d, seq = 3, 32, 21
    qkv = torch.randn(2, seq, 3 * heads * d).to(dtype)
    x = qkv[..., :heads * d].view(2, seq, heads, d).detach().requires_grad_()  # a view, as q out of a fused QKV
    reference = x.detach().clone().requires_grad_()
    tables = _tables(rotary_dim, seq, yarn)
    got = apply_rotary_pos_emb(x, tables)
    cos, sin = (t.unsqueeze(2) for t in tables)
    expected = _rotate_composed(reference.float(), cos, sin, interleaved=False).to(dtype)
    grad = torch.randn(2, seq, d, heads).to(dtype).transpose(-1, -2)  # a non-contiguous gradient
    got.backward(grad)
    expected.backward(grad)
    assert torch.equal(_bits(got), _bits(expected))  # sign bits of zeros included
    assert torch.equal(_bits(x.grad), _bits(reference.grad))


def test_rotates_each_pair_as_float64_math_does():
    torch.manual_seed(0)
    d, seq = 16, 11
    x = torch.randn(2, seq, 2, d, dtype=torch.float64)
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * 500000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]  # [1, s, 1, d/2]
    first, second = x[..., :d // 2], x[..., d // 2:]
    expected = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    got = apply_rotary_pos_emb(x.float(), _tables(d, seq)).double()
    torch.testing.assert_close(got, expected, rtol=0, atol=5e-6)


def test_backward_by_gradcheck():
    torch.manual_seed(0)
    angle = torch.rand(2, 5, 1, 3, dtype=torch.float64) * 6
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    x = torch.randn(2, 5, 2, 8, dtype=torch.float64, requires_grad=True)  # 6 rotated dims, 2 passed through
    assert torch.autograd.gradcheck(lambda t: _RotateHalves.apply(t, cos, sin), (x,))


def test_tables_that_need_a_gradient_take_the_composition():
    torch.manual_seed(0)
    cos, sin = _tables(8, 6)
    cos = cos.clone().requires_grad_()
    x = torch.randn(2, 6, 2, 8, requires_grad=True)
    apply_rotary_pos_emb(x, (cos, sin)).sum().backward()
    assert cos.grad is not None and cos.grad.abs().sum() > 0
