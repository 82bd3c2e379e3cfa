"""GPT-OSS's blocks (megatron/core/transformer/gpt_oss.py) against hand-written references:
attention sinks against the explicit softmax with the sink in the denominator, the sliding
window against its explicit mask and upstream's layer rule, the clamped quick-GEGLU against
its formula; and their parse-time checks."""

import math

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.gpt_oss import gated_activation, is_window_layer, sink_attention, window_allowed
from megatron.core.transformer.mlp import MLP


def _reference_attention(q, k, v, allowed, sink):
    """Per head and query, in float64: p_j = exp(s_j) / (exp(sink) + sum_allowed exp(s_k))."""
    b, heads, sq, d = q.shape
    rep = heads // k.shape[1]
    out = torch.zeros(b, heads, sq, d, dtype=torch.float64)
    for bi in range(b):
        for h in range(heads):
            for i in range(sq):
                s = (k[bi, h // rep].double() @ q[bi, h, i].double()) / math.sqrt(d)
                e = torch.where(allowed[i], s.exp(), torch.zeros_like(s))
                denominator = e.sum() + (0.0 if sink is None else math.exp(float(sink[h])))
                out[bi, h, i] = (e / denominator) @ v[bi, h // rep].double()
    return out


def test_window_mask_and_layer_rule_are_upstreams():
    allowed = window_allowed(6, 6, (2, 0), "cpu")
    explicit = torch.tensor([[i - 2 <= j <= i for j in range(6)] for i in range(6)])
    assert torch.equal(allowed, explicit)
    assert torch.equal(window_allowed(4, 4, (-1, 0), "cpu"), torch.ones(4, 4, dtype=torch.bool).tril())
    assert [is_window_layer((127, 0), 2, n) for n in range(1, 5)] == [True, False, True, False]
    assert [is_window_layer((127, 0), [1, 1, 0], n) for n in range(1, 5)] == [True, True, False, False]
    assert is_window_layer((127, 0), None, 3) and not is_window_layer(None, 2, 1)


@pytest.mark.parametrize("sink_kind", ("learnable", "off-by-one"))
def test_sink_attention_matches_explicit_softmax(sink_kind):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    sink = torch.randn(4) if sink_kind == "learnable" else torch.zeros(4)
    causal = window_allowed(5, 5, (-1, 0), "cpu")
    out = sink_attention(q, k, v, causal, sink)
    torch.testing.assert_close(out.double(), _reference_attention(q, k, v, causal, sink), rtol=1e-5, atol=1e-6)
    # The sink changes the result (rows sum to less than one) ...
    without = _reference_attention(q, k, v, causal, None)
    assert (out.double() - without).abs().max() > 1e-3
    # ... and a row with nothing allowed attends to nothing (no NaN).
    nothing = torch.zeros(5, 5, dtype=torch.bool)
    assert torch.equal(sink_attention(q, k, v, nothing, sink), torch.zeros(2, 4, 5, 8))


def _config(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, add_bias_linear=False)
    base.update(kw)
    return TransformerConfig(**base)


@pytest.mark.parametrize("softmax_type", ("vanilla", "learnable", "off-by-one"))
@pytest.mark.parametrize("layer_number", (1, 2))
def test_self_attention_window_and_sinks(softmax_type, layer_number):
    """layer 1 windowed (skip freq 2), layer 2 full; both against the explicit reference."""
    torch.manual_seed(0)
    config = _config(softmax_type=softmax_type, window_size=(2, 0), window_attn_skip_freq=2)
    attention = SelfAttention(config, layer_number=layer_number)
    if softmax_type == "learnable":
        assert attention.softmax_offset.shape == (4,)
        with torch.no_grad():
            attention.softmax_offset.copy_(torch.tensor([-1.0, 0.0, 0.5, 2.0]))
    x = torch.randn(2, 7, 32)
    out = attention(x)
    q, k, v = (t.transpose(1, 2) for t in attention.split_qkv(attention.linear_qkv(x)))
    allowed = window_allowed(7, 7, (2, 0) if layer_number == 1 else (-1, 0), "cpu")
    sink = {"vanilla": None, "off-by-one": torch.zeros(4)}.get(softmax_type)
    if softmax_type == "learnable":
        sink = attention.softmax_offset.detach()
    context = _reference_attention(q.detach(), k.detach(), v.detach(), allowed, sink).float()
    expected = attention.linear_proj(context.transpose(1, 2).reshape(2, 7, 32))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    if softmax_type == "learnable":
        out.sum().backward()
        assert attention.softmax_offset.grad is not None and attention.softmax_offset.grad.abs().sum() > 0


def test_clamped_quick_geglu_matches_formula():
    torch.manual_seed(0)
    config = _config(gated_linear_unit=True, activation_func="quick_gelu", glu_linear_offset=1.0,
                     activation_func_clamp_value=0.5, ffn_hidden_size=16)
    gate, linear = 2 * torch.randn(3, 16), 2 * torch.randn(3, 16)
    g, lin = torch.minimum(gate, torch.tensor(0.5)), torch.maximum(torch.minimum(linear, torch.tensor(0.5)),
                                                                    torch.tensor(-0.5))
    expected = g * torch.sigmoid(1.702 * g) * (lin + 1.0)
    torch.testing.assert_close(gated_activation(config, gate, linear), expected)
    mlp = MLP(config)
    x = torch.randn(3, 32)
    gate, linear = mlp.linear_fc1(x).chunk(2, dim=-1)
    torch.testing.assert_close(mlp(x), mlp.linear_fc2(gated_activation(config, gate, linear)))


@pytest.mark.parametrize("fields, words", (
    (dict(window_size=(127, 1)), "R must be 0"),
    (dict(window_attn_skip_freq=2), "needs --window-size"),
    (dict(glu_linear_offset=1.0), "gated unit"),
    (dict(softmax_type="sigmoid"), "not known"),
    (dict(window_size=(4, 0), window_attn_skip_freq=[1, 0, 1]), "one 0/1 per layer"),
))
def test_bad_settings_are_refused(fields, words):
    with pytest.raises(ValueError, match=words):
        _config(**fields)


def test_hugging_face_export_refuses_gpt_oss_blocks():
    """The converter writes no gpt_oss model: a checkpoint with the blocks is refused in one line."""
    from tools.checkpoint.hf_conversion import ConversionError, config_from_tensors  # only this test converts

    config = _config(softmax_type="learnable", gated_linear_unit=True, activation_func="quick_gelu",
                     normalization="RMSNorm", position_embedding_type="rope", ffn_hidden_size=16)
    shapes = {k: v.shape for k, v in GPTModel(config, vocab_size=64, max_sequence_length=8).state_dict().items()}
    args = dict(num_attention_heads=4, num_query_groups=2)
    with pytest.raises(ConversionError, match=r"GPT-OSS's blocks \(--softmax-type\)"):
        config_from_tensors(shapes, args)
    shapes = {k: v for k, v in shapes.items() if not k.endswith("softmax_offset")}
    with pytest.raises(ConversionError, match=r"--window-size, --quick-geglu"):
        config_from_tensors(shapes, dict(args, window_size=[127, 0], quick_geglu=True))
