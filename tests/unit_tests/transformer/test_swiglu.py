"""Plain SwiGLU as one autograd function (swiglu._SwiGLU): the bits of ``silu(gate) * up``
over ``chunk``, forward and backward; gradcheck; and the configs that keep the composition."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.swiglu import _SwiGLU, gated_linear_unit, is_plain_swiglu


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_bits_as_the_composition(dtype):
    torch.manual_seed(0)
    x = (3 * torch.randn(2, 9, 2 * 24)).to(dtype).requires_grad_()
    reference = x.detach().clone().requires_grad_()
    got = _SwiGLU.apply(x)
    gate, up = reference.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    grad = torch.randn(24, 9, 2).to(dtype).permute(2, 1, 0)  # a non-contiguous gradient
    got.backward(grad)
    expected.backward(grad)
    assert torch.equal(_bits(got), _bits(expected))
    assert torch.equal(_bits(x.grad), _bits(reference.grad))


def test_backward_by_gradcheck():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_SwiGLU.apply, (x,))


def _config(**overrides):
    fields = dict(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, gated_linear_unit=True,
                  hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False)
    fields.update(overrides)
    return TransformerConfig(**fields)


@pytest.mark.parametrize("overrides", [dict(glu_linear_offset=1.0), dict(activation_func_clamp_value=0.5),
                                       dict(activation_func="quick_gelu"), dict(activation_func="gelu")])
def test_other_gated_units_keep_the_composition(overrides):
    config = _config(**overrides)
    assert not is_plain_swiglu(config)
    torch.manual_seed(0)
    x = 2 * torch.randn(3, 2 * 24)
    gate, up = x.chunk(2, dim=-1)
    if "activation_func_clamp_value" in overrides:
        gate, up = gate.clamp(max=0.5), up.clamp(-0.5, 0.5)
    expected = config.activation(gate) * (up + config.glu_linear_offset)
    torch.testing.assert_close(gated_linear_unit(config, x), expected, rtol=0, atol=0)


def test_the_mlp_uses_it():
    config = _config()
    assert is_plain_swiglu(config)
    torch.manual_seed(0)
    mlp = MLP(config)
    out = mlp(torch.randn(4, 2, 16, requires_grad=True))
    assert out.grad_fn.next_functions[0][0] is not None
    names = set()
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and type(node).__name__ not in names:
            names.add(type(node).__name__)
            stack.extend(f for f, _ in node.next_functions)
    assert "_SwiGLUBackward" in names and "SplitBackward0" not in names
