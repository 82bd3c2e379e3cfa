"""Component tests: attention layout and masking, norms, MLP, layers, recompute, backends."""

import logging
import math
import sys
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron.core.transformer import (
    MLP,
    LayerNorm,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    TransformerBlock,
    TransformerConfig,
    TransformerLayer,
    build_norm,
)
from megatron.core.transformer import backends


def make_config(**overrides):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
    base.update(overrides)
    return TransformerConfig(**base)


def reference_attention(attn: SelfAttention, x, rotary=None, extra_mask=None):
    """Per-head loop over the documented QKV row layout, with an explicit softmax."""
    config = attn.config
    H, G, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    P = H // G
    w = attn.linear_qkv.weight
    bias = attn.linear_qkv.bias
    b, s, _ = x.shape
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    allowed = causal if extra_mask is None else causal & ~extra_mask
    heads = []
    block = (P + 2) * d
    for h in range(H):
        g = h // P
        j = h % P
        rows_q = slice(g * block + j * d, g * block + (j + 1) * d)
        rows_k = slice(g * block + P * d, g * block + (P + 1) * d)
        rows_v = slice(g * block + (P + 1) * d, g * block + (P + 2) * d)
        q = x @ w[rows_q].T + (bias[rows_q] if bias is not None else 0)
        k = x @ w[rows_k].T + (bias[rows_k] if bias is not None else 0)
        v = x @ w[rows_v].T + (bias[rows_v] if bias is not None else 0)
        if rotary is not None:
            cos, sin = rotary
            half = d // 2
            def rot(t):
                t1, t2 = t[..., :half], t[..., half:]
                return t * cos + torch.cat([-t2, t1], dim=-1) * sin
            q, k = rot(q), rot(k)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(~allowed, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v)
    context = torch.cat(heads, dim=-1)
    return attn.linear_proj(context)


@pytest.mark.parametrize("groups", [4, 2, 1])
@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_attention_matches_per_head_reference(groups, use_rope, bias):
    config = make_config(num_query_groups=groups, add_bias_linear=bias)
    attn = SelfAttention(config)
    with torch.no_grad():  # random biases, so a wrong bias layout would show
        for p in attn.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 7, 32)
    rotary = None
    if use_rope:
        positions = torch.arange(7).unsqueeze(0).expand(2, 7)
        rotary = RotaryEmbedding(config.kv_channels, 10000)(positions)
    torch.testing.assert_close(attn(x, rotary_pos_emb=rotary), reference_attention(attn, x, rotary))


def test_attention_explicit_mask_is_combined_with_causal():
    config = make_config(num_query_groups=2)
    attn = SelfAttention(config)
    x = torch.randn(2, 6, 32)
    no_extra = torch.zeros(1, 1, 6, 6, dtype=torch.bool)
    torch.testing.assert_close(attn(x, attention_mask=no_extra), attn(x))
    # Block position 1 from seeing position 0 (a document boundary, say).
    extra = torch.zeros(6, 6, dtype=torch.bool)
    extra[1:, 0] = True
    expected = reference_attention(attn, x, extra_mask=extra)
    torch.testing.assert_close(attn(x, attention_mask=extra.view(1, 1, 6, 6)), expected)
    assert not torch.allclose(expected, attn(x))


def test_rope_rotates_pairs_half_apart_and_preserves_norm():
    rope = RotaryEmbedding(8, rotary_base=100.0)
    cos, sin = rope(torch.tensor([[0, 3]]))
    assert cos.shape == (1, 2, 8)
    torch.testing.assert_close(cos[0, 0], torch.ones(8))  # position 0: identity
    angles = 3 * 100.0 ** (-torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    torch.testing.assert_close(cos[0, 1], torch.cat([angles.cos(), angles.cos()]))
    torch.testing.assert_close(sin[0, 1], torch.cat([angles.sin(), angles.sin()]))


def test_norms_match_definitions_and_keep_dtype():
    x = torch.randn(3, 5, 16) * 3 + 1
    ln = LayerNorm(16, eps=1e-5)
    expected = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    torch.testing.assert_close(ln(x), expected, atol=1e-5, rtol=1e-5)
    rms = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * rms.weight
    torch.testing.assert_close(rms(x), expected)
    rms_bf16 = RMSNorm(16, dtype=torch.bfloat16)
    assert rms_bf16(x.bfloat16()).dtype == torch.bfloat16
    assert [n for n, _ in rms.named_parameters()] == ["weight"]


@pytest.mark.parametrize("gated", [False, True])
def test_mlp_gate_is_first_half_of_fc1(gated):
    config = make_config(gated_linear_unit=gated, ffn_hidden_size=24)
    mlp = MLP(config)
    x = torch.randn(2, 3, 32)
    fc1 = x @ mlp.linear_fc1.weight.T + mlp.linear_fc1.bias
    if gated:
        assert mlp.linear_fc1.weight.shape == (48, 32)
        hidden = F.silu(fc1[..., :24]) * fc1[..., 24:]
    else:
        assert mlp.linear_fc1.weight.shape == (24, 32)
        hidden = F.gelu(fc1)
    torch.testing.assert_close(mlp(x), hidden @ mlp.linear_fc2.weight.T + mlp.linear_fc2.bias)


def test_transformer_layer_is_pre_norm_residual():
    config = make_config()
    layer = TransformerLayer(config)
    x = torch.randn(2, 5, 32)
    h = x + layer.self_attention(layer.input_layernorm(x))
    expected = h + layer.mlp(layer.pre_mlp_layernorm(h))
    torch.testing.assert_close(layer(x), expected)
    names = {n for n, _ in layer.named_modules()}
    assert {"input_layernorm", "self_attention.linear_qkv", "self_attention.linear_proj",
            "pre_mlp_layernorm", "mlp.linear_fc1", "mlp.linear_fc2"} <= names


def test_layer_reset_parameters_restores_megatron_init():
    torch.manual_seed(0)
    config = make_config(hidden_size=64, num_attention_heads=4, num_layers=8)
    layer = TransformerLayer(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(7.0)
    layer.reset_parameters()
    assert torch.all(layer.input_layernorm.weight == 1) and torch.all(layer.input_layernorm.bias == 0)
    assert torch.all(layer.self_attention.linear_qkv.bias == 0)
    std = layer.self_attention.linear_qkv.weight.std().item()
    assert abs(std - 0.02) < 0.002
    proj_std = layer.mlp.linear_fc2.weight.std().item()
    assert abs(proj_std - 0.02 / math.sqrt(16)) < 0.0005


def _run_block(config, seed=0):
    torch.manual_seed(seed)
    block = TransformerBlock(config)
    block.train()
    torch.manual_seed(1)
    x = torch.randn(2, 6, 32, requires_grad=True)
    calls = []
    for layer in block.layers:
        layer.register_forward_pre_hook(lambda module, args: calls.append(module.layer_number))
    torch.manual_seed(2)  # dropout masks
    out = block(x)
    loss = (out * torch.linspace(-1, 1, 32)).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    return loss.detach(), grads, x.grad.clone(), calls


@pytest.mark.parametrize("reentrant", [False, True])
def test_full_recompute_matches_no_recompute(reentrant):
    kwargs = dict(hidden_dropout=0.2, attention_dropout=0.2, num_query_groups=2)
    loss, grads, xgrad, calls = _run_block(make_config(**kwargs))
    loss_rc, grads_rc, xgrad_rc, calls_rc = _run_block(
        make_config(recompute_granularity="full", recompute_reentrant=reentrant, **kwargs))
    assert calls == [1, 2]
    assert sorted(calls_rc) == [1, 1, 2, 2]  # each layer ran again in backward
    torch.testing.assert_close(loss_rc, loss)
    torch.testing.assert_close(xgrad_rc, xgrad)
    assert grads_rc.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_rc[name], grads[name], msg=name)


@pytest.mark.parametrize(
    "recompute, recomputed_layers",
    [
        (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), [1, 2, 3]),
        (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2), [1, 2, 3]),
        (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1), [1]),
        (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2), [1, 2]),
        (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3), [1, 2, 3]),
        (dict(recompute_granularity="selective"), []),
    ],
    ids=["uniform1", "uniform2", "block1", "block2", "block3", "selective"],
)
def test_recompute_variants_match_no_recompute(recompute, recomputed_layers):
    """Every Megatron recompute variant gives the no-recompute loss and gradients (dropout
    on: the masks must be replayed), and reruns exactly the layers it should."""
    kwargs = dict(num_layers=3, hidden_dropout=0.2, attention_dropout=0.2, num_query_groups=2)
    loss, grads, xgrad, calls = _run_block(make_config(**kwargs))
    cores = []
    original_core = SelfAttention.core_attention

    def counting_core(self, *args):
        cores.append(self.layer_number)
        return original_core(self, *args)

    SelfAttention.core_attention = counting_core
    try:
        loss_rc, grads_rc, xgrad_rc, calls_rc = _run_block(make_config(**recompute, **kwargs))
    finally:
        SelfAttention.core_attention = original_core
    assert calls == [1, 2, 3]
    assert sorted(calls_rc) == sorted([1, 2, 3] + recomputed_layers)
    core_reruns = [1, 2, 3] if recompute["recompute_granularity"] == "selective" else recomputed_layers
    assert sorted(cores) == sorted([1, 2, 3] + core_reruns)
    torch.testing.assert_close(loss_rc, loss, rtol=0, atol=0)
    torch.testing.assert_close(xgrad_rc, xgrad)
    assert grads_rc.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_rc[name], grads[name], msg=name)


def test_recompute_is_skipped_in_eval():
    block = TransformerBlock(make_config(recompute_granularity="full"))
    block.eval()
    calls = []
    block.layers[0].register_forward_pre_hook(lambda m, a: calls.append(1))
    block(torch.randn(1, 4, 32, requires_grad=True)).sum().backward()
    assert calls == [1]


def test_transformer_engine_missing_raises_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # makes the import fail
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    config = make_config(transformer_impl="transformer_engine")
    with pytest.raises(RuntimeError, match="Transformer Engine is not installed.*--transformer-impl local"):
        TransformerBlock(config)
    with pytest.raises(RuntimeError, match="--transformer-impl local"):
        build_norm(config, 32)


def _fake_transformer_engine():
    """Stand-in with TE's constructor keywords, to check our wiring (TE itself needs CUDA)."""
    te = types.ModuleType("transformer_engine.pytorch")

    class Linear(nn.Linear):
        def __init__(self, in_features, out_features, bias=True, init_method=None, params_dtype=None,
                     device="cuda"):
            self.init_method = init_method
            self.requested_device = device
            super().__init__(in_features, out_features, bias=bias, dtype=params_dtype)

        def reset_parameters(self, defer_init=False):
            self.init_method(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    class LayerNorm(nn.LayerNorm):
        def __init__(self, hidden_size, eps=1e-5, params_dtype=None, device="cuda"):
            super().__init__(hidden_size, eps=eps, dtype=params_dtype)

    class RMSNorm(nn.RMSNorm):
        def __init__(self, hidden_size, eps=1e-5, params_dtype=None, device="cuda"):
            super().__init__(hidden_size, eps=eps, dtype=params_dtype)

    te.Linear, te.LayerNorm, te.RMSNorm = Linear, LayerNorm, RMSNorm
    package = types.ModuleType("transformer_engine")
    package.pytorch = te
    return package, te


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_transformer_engine_modules_keep_names_and_math(monkeypatch, normalization):
    package, te = _fake_transformer_engine()
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te)
    local = TransformerBlock(make_config(normalization=normalization, num_layers=4))
    te_block = TransformerBlock(make_config(normalization=normalization, num_layers=4,
                                            transformer_impl="transformer_engine"))
    assert isinstance(te_block.layers[0].self_attention.linear_qkv, te.Linear)
    assert isinstance(te_block.layers[0].mlp.linear_fc2, te.Linear)
    assert isinstance(te_block.final_layernorm, te.LayerNorm if normalization == "LayerNorm" else te.RMSNorm)
    assert te_block.layers[0].mlp.linear_fc1.requested_device == torch.device("cuda")
    assert dict(te_block.state_dict()).keys() == dict(local.state_dict()).keys()
    te_block.load_state_dict(local.state_dict())
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(te_block(x), local(x))
    # TE's reset_parameters runs our init method: residual projections get the scaled std.
    torch.manual_seed(0)
    te_block.reset_parameters()
    proj = torch.cat([layer.mlp.linear_fc2.weight.flatten() for layer in te_block.layers])
    assert abs(proj.std().item() - 0.02 / math.sqrt(8)) < 0.001


def test_apex_missing_falls_back_to_local_norm_with_log(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "apex", None)
    backends.apex_norm_class.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=backends.__name__):
            norm = build_norm(make_config(use_apex_fused=True, normalization="RMSNorm"), 32)
    finally:
        backends.apex_norm_class.cache_clear()
    assert type(norm) is RMSNorm
    assert any("apex.normalization.FusedRMSNorm" in r.getMessage() for r in caplog.records)


def test_apex_used_when_importable(monkeypatch):
    apex = types.ModuleType("apex")
    normalization = types.ModuleType("apex.normalization")

    class FusedLayerNorm(nn.LayerNorm):
        def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True):
            super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)

    normalization.FusedLayerNorm = FusedLayerNorm
    apex.normalization = normalization
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.normalization", normalization)
    backends.apex_norm_class.cache_clear()
    try:
        norm = build_norm(make_config(use_apex_fused=True, params_dtype=torch.bfloat16), 32)
        unrequested = build_norm(make_config(), 32)
    finally:
        backends.apex_norm_class.cache_clear()
    assert isinstance(norm, FusedLayerNorm)
    assert norm.weight.dtype == torch.bfloat16
    assert type(unrequested) is LayerNorm
