"""Closed-form parameter and FLOP counts for GPTModel, for logs and sizing runs.

Notation: h = hidden_size, L = num_layers, V = vocab_size, S = max_sequence_length,
d = kv_channels, H = num_attention_heads, G = num_query_groups, q = H * d, kv = G * d,
g = q with attention_output_gate (its gate rows in linear_qkv) else 0, f = ffn_hidden_size,
and [x] is 1 when x holds, else 0.
"""

from typing import Optional

from megatron.core.transformer.gated_delta_net import linear_attention_pattern
from megatron.core.transformer.moe.config import moe_layer_pattern
from megatron.core.transformer.transformer_config import TransformerConfig


def num_parameters(config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                   share_embeddings_and_output_weights: bool = True,
                   position_embedding_type: Optional[str] = None) -> int:
    """Exact number of parameter elements of ``GPTModel`` built with the same arguments.

    embeddings   V*h + [learned_absolute] * S*h
    per layer    2 norms                     2 * (h + [LayerNorm] * h)
                 linear_qkv                  h*(q + g + 2kv) + [bias]*(q + g + 2kv)
                 q/k norms (qk_layernorm)    2 * (d + [LayerNorm] * d)
                 linear_proj                 q*h + [bias]*h
                 linear_fc1                  h*f*m + [bias]*f*m,  m = 2 if gated_linear_unit else 1
                 linear_fc2                  f*h + [bias]*h
    final norm   h + [LayerNorm] * h
    output       [untied] * V*h

    A MoE layer (``moe_layer_freq``) has, instead of the MLP, a router E*h + [bias]*E, E
    experts shaped like the MLP with f = moe_ffn_hidden_size, and a shared expert (an MLP
    of moe_shared_expert_intermediate_size, plus h with moe_shared_expert_gate) when set. The count is the global model's (all
    experts), at any expert-parallel size.

    A gated delta-net layer (``linear_attention_freq``; Hk, Hv key/value heads of dk, dv,
    K the conv kernel, qk = Hk*dk, vv = Hv*dv) has, instead of linear_qkv, the norms and
    linear_proj: in_proj h*(2qk + 2vv + 2Hv), conv1d (2qk + vv)*K, A_log and dt_bias 2Hv,
    out_norm dv + [LayerNorm]*dv, out_proj vv*h (no biases, as upstream).
    """
    if position_embedding_type is None:
        position_embedding_type = config.position_embedding_type
    h = config.hidden_size
    q = config.query_projection_size
    kv = config.kv_projection_size
    qkv = q + config.gate_projection_size + 2 * kv
    f = config.ffn_hidden_size
    bias = 1 if config.add_bias_linear else 0
    norm = h * (2 if config.normalization == "LayerNorm" else 1)
    qk_norms = 2 * norm // h * config.kv_channels if config.qk_layernorm else 0

    embeddings = vocab_size * h
    if position_embedding_type == "learned_absolute":
        embeddings += max_sequence_length * h
    attention = h * qkv + bias * qkv + q * h + bias * h + qk_norms
    def mlp(f):
        fc1_out = f * (2 if config.gated_linear_unit else 1)
        return h * fc1_out + bias * fc1_out + f * h + bias * h

    experts = config.num_moe_experts or 0
    moe = experts * (h + bias) + experts * mlp(config.moe_ffn_hidden_size or f)
    if config.moe_shared_expert_intermediate_size:
        moe += mlp(config.moe_shared_expert_intermediate_size) + (h if config.moe_shared_expert_gate else 0)
    gdn = _gated_delta_net_parameters(config)
    layers = sum(2 * norm + (gdn if linear else attention) + (moe if is_moe else mlp(f))
                 for is_moe, linear in zip(moe_layer_pattern(config), linear_attention_pattern(config)))
    output = 0 if share_embeddings_and_output_weights else vocab_size * h
    return embeddings + layers + norm + output


def _gated_delta_net_parameters(config: TransformerConfig) -> int:
    h, nv, dv = config.hidden_size, config.linear_num_value_heads, config.linear_value_head_dim
    qk, vv = config.linear_num_key_heads * config.linear_key_head_dim, nv * dv
    in_proj = 2 * qk + 2 * vv + 2 * nv
    out_norm = dv * (2 if config.normalization == "LayerNorm" else 1)
    return h * in_proj + (2 * qk + vv) * config.linear_conv_kernel_dim + 2 * nv + out_norm + vv * h


def flops_per_token(config: TransformerConfig, vocab_size: int, seq_length: int) -> int:
    """Training FLOPs per token (forward + backward), for a TFLOP/s or MFU log line.

    Counts matrix multiplies only, at 2 FLOPs per multiply-add; forward per token is

        L * ( 2h(q + g + 2kv)      QKV projection (and the output gate)
            + 4 * seq_length * q   attention scores Q K^T and the weighted sum with V
            + 2qh                  output projection
            + 2hf*m + 2fh )        MLP (m = 2 for gated linear units)
        + 2hV                      logits

    and backward costs twice the forward (gradients w.r.t. inputs and weights), so the
    result is 3x the forward. Conventions, chosen to match the usual "model FLOPs"
    definition (PaLM / Megatron): the attention term counts the full seq_length x
    seq_length score matrix, although causal kernels skip about half of it; recomputation
    (recompute_granularity="full") is not counted, since it is extra work the hardware does
    but not progress; norms, activations, softmax, embedding lookups and the loss are
    ignored (they are O(h) per token, not O(h^2)).

    A MoE layer counts, instead of the MLP, the router 2hE and each token's top-k experts
    (k times the MLP term with f = moe_ffn_hidden_size), plus the shared expert's MLP term.
    Dropped tokens are not subtracted.

    A gated delta-net layer counts, instead of the attention terms, its projections
    2h(2qk + 2vv + 2Hv) + 2vv*h, the convolution 2(2qk + vv)K and the recurrence's three
    [dk, dv] products per value head and token (predict, write, read): 6*Hv*dk*dv.
    """
    h = config.hidden_size
    q = config.query_projection_size
    kv = config.kv_projection_size
    f = config.ffn_hidden_size
    gated = 2 if config.gated_linear_unit else 1

    def mlp(f):
        return 2 * h * f * gated + 2 * f * h

    attention = 2 * h * (q + config.gate_projection_size + 2 * kv) + 4 * seq_length * q + 2 * q * h
    moe = 2 * h * (config.num_moe_experts or 0) + config.moe_router_topk * mlp(config.moe_ffn_hidden_size or f)
    if config.moe_shared_expert_intermediate_size:
        moe += mlp(config.moe_shared_expert_intermediate_size)
    nv = config.linear_num_value_heads
    qk, vv = config.linear_num_key_heads * config.linear_key_head_dim, nv * config.linear_value_head_dim
    gdn = (2 * h * (2 * qk + 2 * vv + 2 * nv) + 2 * vv * h + 2 * (2 * qk + vv) * config.linear_conv_kernel_dim
           + 6 * nv * config.linear_key_head_dim * config.linear_value_head_dim)
    forward = sum((gdn if linear else attention) + (moe if is_moe else mlp(f))
                  for is_moe, linear in zip(moe_layer_pattern(config), linear_attention_pattern(config)))
    forward += 2 * h * vocab_size
    return 3 * forward
