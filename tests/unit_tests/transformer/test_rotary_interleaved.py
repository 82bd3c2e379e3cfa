"""--rotary-interleaved: RoPE pairs (2i, 2i+1), against an independent reference (each
pair a complex number times exp(i * position * theta_i)), in the model, at parse time,
and refused by the Hugging Face converter (whose styles rotate halves)."""

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import RotaryEmbedding, TransformerConfig, apply_rotary_pos_emb
from megatron.training.arguments import parse_args

BASE = 10000.0


def reference(x, positions, rotated_dims):
    """Interleaved RoPE as complex multiplication, in float64; dims past rotated_dims pass."""
    d = rotated_dims
    theta = BASE ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    angle = positions.to(torch.float64)[..., None, None] * theta  # [b, s, 1, d/2]
    pairs = torch.view_as_complex(x[..., :d].double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    out = torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)).flatten(-2)
    return torch.cat((out, x[..., d:].double()), dim=-1)


@pytest.mark.parametrize("rotated_dims", [16, 8])  # all of a 16-dim head, and --rotary-percent 0.5
def test_interleaved_matches_the_complex_reference(rotated_dims):
    torch.manual_seed(0)
    x = torch.randn(2, 40, 3, 16)
    positions = torch.arange(40).expand(2, 40)
    tables = RotaryEmbedding(rotated_dims, BASE, interleaved=True)(positions)
    got = apply_rotary_pos_emb(x, tables)
    torch.testing.assert_close(got.double(), reference(x, positions, rotated_dims), rtol=0, atol=2e-6)
    # The default layout is a different rotation of the same vector (not a relabelled copy).
    half = apply_rotary_pos_emb(x, RotaryEmbedding(rotated_dims, BASE)(positions))
    assert not torch.allclose(got, half, atol=1e-3)


def _config(interleaved):
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=64, hidden_dropout=0.0, attention_dropout=0.0,
                             position_embedding_type="rope", rotary_interleaved=interleaved,
                             init_method_std=0.3)  # sharp attention: the position encoding shows in the logits


def test_model_with_interleaved_rope_equals_rotate_half_on_permuted_qk_rows():
    # Interleaved pair (2i, 2i+1) is rotate-half pair (i, i + d/2) once each q and k head's
    # rows are reordered [0, 2, 4, ..., 1, 3, 5, ...]: the logits must agree.
    torch.manual_seed(0)
    interleaved = GPTModel(_config(True), vocab_size=64, max_sequence_length=16)
    half = GPTModel(_config(False), vocab_size=64, max_sequence_length=16)
    state = interleaved.state_dict()
    d, per_group = 8, 2 + 2  # head dim; per query group: 2 query heads, one key, one value head
    order = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
    for key in [k for k in state if k.endswith("linear_qkv.weight")]:
        w = state[key].view(2, per_group, d, -1).clone()
        w[:, :3] = w[:, :3, order]  # query and key heads; values keep their rows
        state[key] = w.view_as(state[key])
    half.load_state_dict(state)
    tokens = torch.randint(0, 64, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    a = interleaved(tokens, positions, None)
    b = half(tokens, positions, None)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Without the permutation the two layouts differ: the flag reaches the attention.
    half.load_state_dict(interleaved.state_dict())
    assert (a - half(tokens, positions, None)).abs().max() > 1e-2


def test_flag_parses_with_rope_only():
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100", "--rotary-interleaved"]
    with pytest.raises(ValueError, match="--rotary-interleaved applies to RoPE"):
        parse_args(argv, world_size=1, cuda_available=False)
    args = parse_args(argv + ["--position-embedding-type", "rope"], world_size=1, cuda_available=False)
    assert args.rotary_interleaved


def test_hugging_face_conversion_refuses_interleaved_rope():
    from tools.checkpoint.hf_conversion import ConversionError, config_from_tensors, to_hf

    model = GPTModel(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                                       normalization="RMSNorm", gated_linear_unit=True, activation_func="silu",
                                       add_bias_linear=False, position_embedding_type="rope",
                                       rotary_interleaved=True), vocab_size=64, max_sequence_length=16)
    tensors = model.state_dict()
    config = config_from_tensors(tensors, dict(num_attention_heads=4, rotary_interleaved=True))
    assert "--rotary-interleaved" in config.command_line() and config.to_megatron_args()["rotary_interleaved"]
    with pytest.raises(ConversionError, match=r"--rotary-interleaved .*\(--to safetensors\)"):
        to_hf(tensors, config)
    config.rotary_interleaved = False
    assert config.style == "llama"  # the same model with rotate-half RoPE converts
