import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megatron.core.models.gpt import GPTModel, flops_per_token, num_parameters
from megatron.core.transformer import TransformerConfig

CONFIGS = {
    "gpt2_like": (dict(), True, None),
    "gqa": (dict(num_attention_heads=8, num_query_groups=2), True, None),
    "mqa_swiglu": (dict(num_attention_heads=4, num_query_groups=1, gated_linear_unit=True, ffn_hidden_size=40), True, None),
    "rmsnorm_nobias_untied": (dict(normalization="RMSNorm", add_bias_linear=False), False, None),
    "llama_like": (dict(normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
                        num_query_groups=2, position_embedding_type="rope"), False, None),
    "rope_override": (dict(kv_channels=6), True, "rope"),
    # Every other layer a MoE (top-2 of 4 SwiGLU experts) with a shared expert.
    "moe_interleaved_shared": (dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_layer_freq=2,
                                    moe_shared_expert_intermediate_size=16, gated_linear_unit=True), False, None),
    # Qwen3-Next-like hybrid: gated delta nets on layers 1 and 2, gated softmax attention on 3.
    "gdn_hybrid": (dict(normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
                        attention_output_gate=True, experimental_attention_variant="gdn", linear_attention_freq=3,
                        linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_conv_kernel_dim=3), False, None),
    "gdn_list_layernorm_bias": (dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=[0, 1, 1],
                                     gated_linear_unit=True,
                                     linear_key_head_dim=4, linear_value_head_dim=4, linear_num_key_heads=2,
                                     linear_num_value_heads=2), True, None),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_num_parameters_formula_is_exact(name):
    overrides, tied, pos = CONFIGS[name]
    config = TransformerConfig(**{**dict(num_layers=3, hidden_size=32, num_attention_heads=4), **overrides})
    model = GPTModel(config, 100, 24, share_embeddings_and_output_weights=tied, position_embedding_type=pos)
    assert num_parameters(config, 100, 24, tied, position_embedding_type=pos) == sum(
        p.numel() for p in model.parameters())


def _matmul_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Attention written as explicit matmuls, which FlopCounterMode can count on CPU."""
    if enable_gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = q.shape[-2]
    allowed = torch.ones(s, s, dtype=torch.bool).tril() if is_causal else attn_mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("name", ["gpt2_like", "llama_like", "mqa_swiglu", "moe_interleaved_shared"])
@pytest.mark.parametrize("tied", [True, False])
def test_flops_per_token_matches_counted_training_flops(monkeypatch, name, tied):
    overrides, _, _ = CONFIGS[name]
    config = TransformerConfig(**{**dict(num_layers=2, hidden_size=32, num_attention_heads=4), **overrides})
    model = GPTModel(config, 96, 32, share_embeddings_and_output_weights=tied)
    monkeypatch.setattr(F, "scaled_dot_product_attention", _matmul_attention)
    batch, seq = 2, 12
    ids = torch.randint(0, 96, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).sum().backward()
    assert counter.get_total_flops() == batch * seq * flops_per_token(config, 96, seq)
