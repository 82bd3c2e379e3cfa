"""YaRN RoPE scaling (--position-embedding-type yarn): the rotary tables against an
independent float64 reference written from the definition, against Hugging Face's
DeepSeek-V3 rotary embedding built from a config (no download), and in the model."""

import math

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import RotaryEmbedding, TransformerConfig, apply_rotary_pos_emb
from megatron.core.transformer.rope import YarnScaling

# (scaling factor, original context, beta_fast, beta_slow, mscale, mscale_all_dim, round)
CASES = {
    "deepseek_v3": (40.0, 4096, 32.0, 1.0, 1.0, 1.0, True),       # DeepSeek-V3's own values
    "gpt_oss": (32.0, 4096, 32.0, 1.0, 1.0, 0.0, True),           # concentration 0.1 ln s + 1
    "short_context": (4.0, 64, 16.0, 2.0, 0.707, 1.0, True),      # a ramp inside a 32-dim head
    "fractional_ramp": (8.0, 256, 32.0, 1.0, 1.0, 0.5, False),
}
DIM, BASE = 32, 10000.0


def reference_tables(positions, dim, base, s, original, beta_fast, beta_slow, mscale, mscale_all_dim, round_to_int):
    """Per pair i (float64, Python math): theta_i = base^(-2i/dim) turns r_i = original *
    theta_i / (2 pi) times over the original context. The pairs whose index lies below
    the one that turns beta_fast times keep theta_i, those above the one that turns
    beta_slow times use theta_i / s, linear in the index between (Megatron-LM's and
    DeepSeek's ramp). cos/sin carry (0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1)."""
    def index_turning(times):
        # r(x) = original / (2 pi) * base^(-2x/dim) = times  <=>  x = dim/2 * log_base(original / (2 pi times))
        return dim / 2 * math.log(original / (2 * math.pi * times)) / math.log(base)

    low, high = index_turning(beta_fast), index_turning(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    thetas = []
    for i in range(dim // 2):
        theta = base ** (-2 * i / dim)
        keep = 1.0 - min(max((i - low) / (high - low), 0.0), 1.0)
        thetas.append(theta * keep + theta / s * (1 - keep))
    theta = torch.tensor(thetas, dtype=torch.float64)

    def m(a):
        return 1.0 if s <= 1 else 0.1 * a * math.log(s) + 1.0

    angle = positions.double()[..., None] * torch.cat((theta, theta))
    factor = m(mscale) / m(mscale_all_dim)
    return angle.cos() * factor, angle.sin() * factor, theta


def _yarn(case):
    s, original, fast, slow, mscale, mscale_all_dim, round_to_int = CASES[case]
    return YarnScaling(s, original, fast, slow, mscale, mscale_all_dim, round_to_int)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tables_match_the_independent_reference(case):
    positions = torch.arange(0, 6000, 7).expand(2, -1)
    cos, sin = RotaryEmbedding(DIM, BASE, yarn=_yarn(case))(positions)
    ref_cos, ref_sin, ref_theta = reference_tables(positions, DIM, BASE, *CASES[case])
    # fp32 angles of positions up to 6000: a few ulps of 6000 rad.
    torch.testing.assert_close(cos.double(), ref_cos, rtol=0, atol=3e-3)
    torch.testing.assert_close(sin.double(), ref_sin, rtol=0, atol=3e-3)
    # The frequencies themselves are exact to fp32 rounding.
    torch.testing.assert_close(_yarn(case).inverse_frequencies(DIM, BASE).double(), ref_theta, rtol=1e-6, atol=0)


def test_the_ramp_keeps_fast_pairs_and_interpolates_slow_ones():
    yarn = _yarn("short_context")
    plain = 1.0 / BASE ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM)
    got = yarn.inverse_frequencies(DIM, BASE)
    assert torch.equal(got[0], plain[0]) and torch.allclose(got[-1], plain[-1] / 4.0)
    assert ((got >= plain / 4.0 * (1 - 1e-6)) & (got <= plain * (1 + 1e-6))).all()
    assert (got < plain * 0.99).any() and (got > plain / 4.0 * 1.01).any()  # a ramp between them
    # Scaling factor 1: plain RoPE, concentration 1.
    one = RotaryEmbedding(DIM, BASE, yarn=YarnScaling(1.0))(torch.arange(50)[None])
    rope = RotaryEmbedding(DIM, BASE)(torch.arange(50)[None])
    assert torch.equal(one[0], rope[0]) and torch.equal(one[1], rope[1])


def _hf_rotary(case):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    s, original, fast, slow, mscale, mscale_all_dim, round_to_int = CASES[case]
    config = DeepseekV3Config(
        vocab_size=64, hidden_size=64, num_attention_heads=2, num_hidden_layers=1, qk_rope_head_dim=DIM,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=int(original * s),
        rope_parameters={"rope_type": "yarn", "rope_theta": BASE, "factor": s,
                         "original_max_position_embeddings": original, "beta_fast": fast, "beta_slow": slow,
                         "mscale": mscale, "mscale_all_dim": mscale_all_dim, "truncate": round_to_int})
    return DeepseekV3RotaryEmbedding(config)


# Hugging Face takes get_mscale(s) when mscale or mscale_all_dim is 0 (falsy), Megatron-LM
# m(s, mscale) / m(s, mscale_all_dim): the two agree in every case here (mscale 1 with
# mscale_all_dim 0 is the same number); they would differ for mscale != 1 with mscale_all_dim 0.
@pytest.mark.parametrize("case", sorted(CASES))
def test_tables_equal_hugging_face_deepseek_v3(case):
    hf = _hf_rotary(case)
    positions = torch.arange(0, 3000, 3).expand(2, -1)
    x = torch.randn(2, positions.shape[1], DIM)
    hf_cos, hf_sin = hf(x, positions)
    cos, sin = RotaryEmbedding(DIM, BASE, yarn=_yarn(case))(positions)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=1e-6)
    # Applied to q and k as Hugging Face applies them (rotate half, DeepSeek's rope_interleave off).
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb as hf_apply

    q, k = torch.randn(2, 4, positions.shape[1], DIM), torch.randn(2, 1, positions.shape[1], DIM)
    hf_q, hf_k = hf_apply(q, k, hf_cos, hf_sin)
    tables = RotaryEmbedding(DIM, BASE, yarn=_yarn(case))(positions)
    ours_q = apply_rotary_pos_emb(q.transpose(1, 2), tables).transpose(1, 2)  # ours: [b, s, heads, d]
    ours_k = apply_rotary_pos_emb(k.transpose(1, 2), tables).transpose(1, 2)
    torch.testing.assert_close(ours_q, hf_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_k, hf_k, rtol=1e-5, atol=1e-5)


def _config(**kw):
    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=2, ffn_hidden_size=64,
                             hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3, **kw)


def test_model_uses_the_yarn_tables():
    yarn = dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0,
                yarn_original_max_position_embeddings=64, yarn_beta_fast=16.0, yarn_beta_slow=2.0,
                yarn_mscale=0.707, yarn_mscale_all_dim=1.0)
    torch.manual_seed(0)
    model = GPTModel(_config(**yarn), vocab_size=64, max_sequence_length=128)
    rope = GPTModel(_config(position_embedding_type="rope"), vocab_size=64, max_sequence_length=128)
    rope.load_state_dict(model.state_dict())
    assert model.rotary_pos_emb.yarn == YarnScaling(4.0, 64, 16.0, 2.0, 0.707, 1.0)
    tokens = torch.randint(0, 64, (2, 96))
    positions = torch.arange(96).expand(2, 96)
    # The layer sees YaRN's tables: the same logits as a RoPE model whose attention gets them.
    layer = rope.decoder.layers[0]
    handle = layer.register_forward_pre_hook(
        lambda module, args: (args[0], args[1], model.rotary_pos_emb(positions)))
    try:
        expected = rope(tokens, positions, None)
    finally:
        handle.remove()
    got = model(tokens, positions, None)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.allclose(got, rope(tokens, positions, None), atol=1e-3)


@pytest.mark.parametrize("kw, message", [
    (dict(rotary_interleaved=True), "rotates halves"),
    (dict(rotary_percent=0.5), "every head dimension"),
    (dict(yarn_rotary_scaling_factor=0.0), "scaling factor must be positive"),
    (dict(yarn_beta_slow=-1.0), "beta_fast and beta_slow"),
])
def test_bad_yarn_configs_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        _config(position_embedding_type="yarn", **kw)
