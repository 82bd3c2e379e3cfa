"""Multi-latent attention (DeepSeek-V2/V3), Megatron-LM's ``MLASelfAttention`` names and
semantics, batch-first.

With H heads, ``qk_head_dim`` = d_n (the part of q/k without position), ``qk_pos_emb_head_dim``
= d_r (the decoupled RoPE part), ``v_head_dim`` = d_v, ``q_lora_rank`` = r_q and
``kv_lora_rank`` = r_kv, for hidden states x [b, s, h]::

    c_q  = q_layernorm(linear_q_down_proj(x))                    [b, s, r_q]
    q    = linear_q_up_proj(c_q)                                 [b, s, H, d_n + d_r]
           (or linear_q_proj(x) when q_lora_rank is None)
    c_kv, k_r = split(linear_kv_down_proj(x), [r_kv, d_r])       k_r is one head, shared by all
    k_n, v    = split(linear_kv_up_proj(kv_layernorm(c_kv)), [d_n, d_v])   per head
    q = [q_n, rope(q_r)],  k = [k_n, rope(k_r)]                  [b, s, H, d_n + d_r]
    out = linear_proj(softmax(q k^T / sqrt(d_n + d_r)) v)        causal

Row layouts (what the converters rely on): ``linear_q_up_proj`` / ``linear_q_proj`` rows are
head-major, each head ``[d_n nope rows; d_r rope rows]``; ``linear_kv_up_proj`` rows are
head-major, each head ``[d_n key rows; d_v value rows]``; ``linear_kv_down_proj`` rows are
``[r_kv latent rows; d_r rope-key rows]``. Hugging Face DeepSeek-V3 has the same layouts
(``q_b_proj``, ``kv_b_proj``, ``kv_a_proj_with_mqa``).

``q_layernorm`` / ``kv_layernorm`` (the latent norms, ``normalization``'s kind) exist only
with ``qk_layernorm``, as in upstream's local spec (DeepSeek's ``q_a_layernorm`` /
``kv_a_layernorm``); without it they are identities.

RoPE: Megatron's ``mla_rotary_interleaved``: the d_r dimensions of q_r and k_r are read as
pairs (2i, 2i + 1), reordered to [evens, odds] and rotated half-wise (Hugging Face
DeepSeek-V3's ``rope_interleave``). The result stays in that order; q and k share it, so
the scores do not depend on it. The tables come from the model (``RotaryEmbedding`` of
size d_r, plain RoPE: upstream's YaRN at scaling factor 1 is the same).

Tensor parallelism: the down projections (and the latent norms) are replicated, every rank
computing the whole latents; the up projections are column-parallel (whole heads per
rank) and ``linear_proj`` row-parallel, so a rank holds H / T heads. The up projections'
inputs pass ``copy_to_tensor_model_parallel_region`` (inside the column-parallel layer), so
the latents' gradients are summed over the heads of every rank; the shared k_r goes
through the same region itself. With sequence parallelism the latents are computed on
the rank's chunk, the column-parallel layers gather them, and k_r is gathered with
``gather_from_sequence_parallel_region`` (backward: the heads' partial gradients summed
and scattered); the replicated weights' chunk gradients are summed by ``finalize_grads``.
Upstream can make the down projections column-parallel and gather their outputs: the
same values, a different split of the work.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from .attention import SelfAttention
from .document_mask import sdpa_mask_and_causal
from .layers import build_linear, build_parallel_linear, output_init_std
from .norms import build_norm
from .recompute import recomputes
from .rope import apply_rotary_pos_emb
from .transformer_config import TransformerConfig


def apply_mla_rotary_pos_emb(x: torch.Tensor, rotary_pos_emb) -> torch.Tensor:
    """RoPE on x [b, s, heads, d_r] with MLA's pair order: (2i, 2i + 1) -> [evens, odds], then
    the half-wise rotation (Megatron's ``mla_rotary_interleaved``)."""
    x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return apply_rotary_pos_emb(x, rotary_pos_emb, interleaved=False)


class MLASelfAttention(SelfAttention):
    """Multi-latent self-attention (module docstring). Shares ``core_attention`` and the
    context-free parts of ``SelfAttention``; builds its own projections."""

    def __init__(self, config: TransformerConfig, layer_number: int = 1):
        nn.Module.__init__(self)
        self.config = config
        self.layer_number = layer_number
        tp = config.tensor_model_parallel_size
        heads = config.num_attention_heads
        self.num_heads = heads // tp
        self.num_query_groups = self.num_heads  # every head has its own k and v (no GQA)
        self.qk_head_dim, self.rope_dim, self.v_head_dim = (config.qk_head_dim, config.qk_pos_emb_head_dim,
                                                            config.v_head_dim)
        self.q_head_dim = self.qk_head_dim + self.rope_dim
        self.gated = False
        # GPT-OSS's window and sinks are refused with MLA (TransformerConfig): full causal softmax.
        self.window_size, self.softmax_type = None, "vanilla"
        self.q_layernorm = self.kv_layernorm = self.k_layernorm = self.qk_norm_group = None
        std = config.init_method_std
        if config.q_lora_rank is None:
            self.linear_q_proj = build_parallel_linear(config, config.hidden_size, heads * self.q_head_dim,
                                                       bias=False, init_std=std, split="column")
        else:
            self.linear_q_down_proj = build_linear(config, config.hidden_size, config.q_lora_rank, bias=False,
                                                   init_std=std)
            self.linear_q_up_proj = build_parallel_linear(config, config.q_lora_rank, heads * self.q_head_dim,
                                                          bias=False, init_std=std, split="column")
        self.linear_kv_down_proj = build_linear(config, config.hidden_size, config.kv_lora_rank + self.rope_dim,
                                                bias=False, init_std=std)
        self.linear_kv_up_proj = build_parallel_linear(config, config.kv_lora_rank,
                                                       heads * (self.qk_head_dim + self.v_head_dim), bias=False,
                                                       init_std=std, split="column")
        if config.qk_layernorm:
            if config.q_lora_rank is not None:
                self.q_layernorm = build_norm(config, config.q_lora_rank)
            self.kv_layernorm = build_norm(config, config.kv_lora_rank)
        self.linear_proj = build_parallel_linear(config, heads * self.v_head_dim, config.hidden_size,
                                                 bias=config.add_bias_linear, init_std=output_init_std(config),
                                                 split="row")

    def query_key_value(self, hidden_states: torch.Tensor, rotary_pos_emb) -> Tuple[torch.Tensor, ...]:
        """q, k [b, s, heads, d_n + d_r] and v [b, s, heads, d_v] (the whole sequence under SP).
        With ``--recompute-modules mla_up_proj`` the up projections and RoPE (everything after
        the latents) keep only their inputs and run again in backward, as upstream's."""
        config = self.config
        q_latent = q = None
        if config.q_lora_rank is None:
            q = self.linear_q_proj(hidden_states)
        else:
            q_latent = self.linear_q_down_proj(hidden_states)
            if self.q_layernorm is not None:
                q_latent = self.q_layernorm(q_latent)
        kv_latent, k_rope = torch.split(self.linear_kv_down_proj(hidden_states),
                                        [config.kv_lora_rank, self.rope_dim], dim=-1)
        if self.kv_layernorm is not None:
            kv_latent = self.kv_layernorm(kv_latent)
        if config.tensor_model_parallel_size > 1:
            # The shared rope key feeds every head of every rank: its gradient is their sum.
            k_rope = (gather_from_sequence_parallel_region(k_rope, config.tp_group) if config.sequence_parallel
                      else copy_to_tensor_model_parallel_region(k_rope, config.tp_group))
        if recomputes(config, "mla_up_proj") and self.training and torch.is_grad_enabled():
            return checkpoint(self._up_projections_and_rope, q, q_latent, kv_latent, k_rope, rotary_pos_emb,
                              use_reentrant=False)
        return self._up_projections_and_rope(q, q_latent, kv_latent, k_rope, rotary_pos_emb)

    def _up_projections_and_rope(self, q, q_latent, kv_latent, k_rope, rotary_pos_emb):
        """q (given, or the up projection of ``q_latent``), k and v from the latents, RoPE applied."""
        if q is None:
            q = self.linear_q_up_proj(q_latent)
        kv = self.linear_kv_up_proj(kv_latent)
        b, s, _ = q.shape
        q_nope, q_rope = torch.split(q.view(b, s, self.num_heads, self.q_head_dim), [self.qk_head_dim, self.rope_dim],
                                     dim=-1)
        k_nope, v = torch.split(kv.view(b, s, self.num_heads, self.qk_head_dim + self.v_head_dim),
                                [self.qk_head_dim, self.v_head_dim], dim=-1)
        k_rope = k_rope.unsqueeze(2)
        if rotary_pos_emb is not None:
            q_rope = apply_mla_rotary_pos_emb(q_rope, rotary_pos_emb)
            k_rope = apply_mla_rotary_pos_emb(k_rope, rotary_pos_emb)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(b, s, self.num_heads, self.rope_dim)), dim=-1)
        return q, k, v

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb=None) -> torch.Tensor:
        """hidden_states [b, s, h] -> [b, s, h]; ``attention_mask`` and ``rotary_pos_emb`` as
        for ``SelfAttention`` (the tables of size ``qk_pos_emb_head_dim``)."""
        q, k, v = self.query_key_value(hidden_states, rotary_pos_emb)
        b, s = q.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        attn_mask, is_causal = sdpa_mask_and_causal(attention_mask, s, hidden_states.device)
        # SDPA's default scale is 1 / sqrt(q's last dim) = 1 / sqrt(d_n + d_r), upstream's softmax_scale.
        if recomputes(self.config, "core_attn") and self.training and torch.is_grad_enabled():
            context = checkpoint(self.core_attention, q, k, v, attn_mask, is_causal, use_reentrant=False)
        else:
            context = self.core_attention(q, k, v, attn_mask, is_causal)
        return self.linear_proj(context.transpose(1, 2).reshape(b, s, self.num_heads * self.v_head_dim))
