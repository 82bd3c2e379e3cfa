"""Behaviour of the Megatron-LM model flags: --kv-channels, --rotary-percent,
--apply-layernorm-1p, --attention-softmax-in-fp32 and --attention-backend."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import LayerNorm, RotaryEmbedding, SelfAttention, TransformerConfig, apply_rotary_pos_emb, build_norm


def config(**overrides):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
    base.update(overrides)
    return TransformerConfig(**base)


def test_kv_channels_sets_the_head_dimension_independently_of_the_hidden_size():
    cfg = config(kv_channels=12, num_query_groups=2)
    attn = SelfAttention(cfg)
    # (H + 2G) * d rows in, H * d columns out of the heads.
    assert attn.linear_qkv.weight.shape == ((4 + 2 * 2) * 12, 32)
    assert attn.linear_proj.weight.shape == (32, 4 * 12)
    model = GPTModel(config(kv_channels=12), vocab_size=64, max_sequence_length=16)
    loss = model(torch.randint(0, 64, (2, 16)), labels=torch.randint(0, 64, (2, 16)))
    assert loss.shape == (2, 16) and torch.isfinite(loss).all()
    loss.mean().backward()


def test_rotary_percent_rotates_only_the_leading_dimensions():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 3, 8)
    pos = torch.arange(6).unsqueeze(0).expand(2, 6)
    partial = apply_rotary_pos_emb(x, RotaryEmbedding(4)(pos))
    # The last 4 dimensions pass through; the first 4 are a full RoPE of dimension 4.
    assert torch.equal(partial[..., 4:], x[..., 4:])
    assert torch.allclose(partial[..., :4], apply_rotary_pos_emb(x[..., :4].contiguous(), RotaryEmbedding(4)(pos)))
    assert not torch.allclose(partial[..., :4], x[..., :4])
    model = GPTModel(config(position_embedding_type="rope", rotary_percent=0.5), vocab_size=64, max_sequence_length=16)
    assert model.rotary_pos_emb.kv_channels == 4  # half of the 8-dimensional heads
    full = GPTModel(config(position_embedding_type="rope"), vocab_size=64, max_sequence_length=16)
    full.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 64, (1, 16))
    assert not torch.allclose(model(tokens), full(tokens))
    with pytest.raises(ValueError, match="even number"):
        config(position_embedding_type="rope", rotary_percent=0.4)


def test_layernorm_1p_stores_gamma_minus_one():
    norm = build_norm(config(apply_layernorm_1p=True), 32)
    assert isinstance(norm, LayerNorm) and torch.equal(norm.weight, torch.zeros(32))
    x = torch.randn(4, 32)
    assert torch.allclose(norm(x), F.layer_norm(x, (32,)))
    with torch.no_grad():
        norm.weight.fill_(0.5)
    assert torch.allclose(norm(x), F.layer_norm(x, (32,)) * 1.5)
    # Weight decay on the stored weight pulls gamma towards 1, not 0.
    plain = build_norm(config(), 32)
    assert torch.equal(plain.weight, torch.ones(32))
    # RMSNorm too (upstream's Llama-3 scripts: TE's RMSNorm with zero_centered_gamma).
    rms = build_norm(config(apply_layernorm_1p=True, normalization="RMSNorm"), 32)
    assert torch.equal(rms.weight, torch.zeros(32))
    with torch.no_grad():
        rms.weight.fill_(0.5)
    assert torch.allclose(rms(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + rms.eps) * 1.5)


def test_attention_softmax_in_fp32_computes_attention_in_fp32():
    torch.manual_seed(0)
    low = SelfAttention(config(params_dtype=torch.bfloat16))
    high = SelfAttention(config(params_dtype=torch.bfloat16, attention_softmax_in_fp32=True))
    high.load_state_dict(low.state_dict())
    x = (torch.randn(2, 64, 32) * 4).to(torch.bfloat16)
    q, k, v = (t.transpose(1, 2) for t in low.split_qkv(low.linear_qkv(x)))
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(torch.bfloat16)
    reference = low.linear_proj(reference.transpose(1, 2).reshape(2, 64, 32))
    out = high(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference)
    assert not torch.equal(low(x), reference)  # bf16 attention rounds differently


def test_attention_backend_selects_the_sdpa_kernels():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    outs = {}
    for backend in ("auto", "unfused", "local", "flash"):
        torch.manual_seed(1)
        outs[backend] = SelfAttention(config(attention_backend=backend)).eval()(x)
    assert torch.allclose(outs["unfused"], outs["auto"], atol=1e-6)
    assert torch.allclose(outs["flash"], outs["auto"], atol=1e-6)
    # The choice is binding: CPU has no fused (memory-efficient/cuDNN) kernel, and its
    # flash kernel takes no dropout, while the math kernel does.
    with pytest.raises(RuntimeError):
        SelfAttention(config(attention_backend="fused"))(x)
    with pytest.raises(RuntimeError):
        SelfAttention(config(attention_backend="flash", attention_dropout=0.5)).train()(x)
    SelfAttention(config(attention_backend="unfused", attention_dropout=0.5)).train()(x)
    with pytest.raises(ValueError, match="attention_backend"):
        config(attention_backend="cudnn")
