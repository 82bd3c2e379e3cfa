"""Gated delta-net linear attention (Qwen3-Next's linear layers; Megatron-LM's
``--experimental-attention-variant gdn``, alias ``gated_delta_net``), in plain PyTorch.

A hybrid model puts this module in place of ``self_attention`` on the layers that
``--linear-attention-freq`` marks (``linear_attention_pattern``); the other layers keep
softmax attention (attention.py, usually with ``--attention-output-gate``).

Parameters (Megatron-LM's names; ``H_k`` = linear_num_key_heads, ``H_v`` =
linear_num_value_heads, ``d_k`` / ``d_v`` their head dims, ``K`` the conv kernel):

* ``in_proj.weight`` ``[2*H_k*d_k + 2*H_v*d_v + 2*H_v, hidden]``: rows ``[q; k; v; z; b; a]``,
  each block heads in order (q, k: ``H_k`` heads of ``d_k``; v, z: ``H_v`` heads of ``d_v``;
  b, a: one row per value head). Under tensor parallelism each block is split on its own
  (a rank holds its heads of every block, upstream's per-rank ``[q k v z b a]``).
* ``conv1d.weight`` ``[2*H_k*d_k + H_v*d_v, 1, K]``: a depthwise causal convolution over the
  channels ``[q; k; v]`` (same order), no bias, followed by SiLU.
* ``A_log``, ``dt_bias`` ``[H_v]``: per-head decay ``g = -exp(A_log) * softplus(a + dt_bias)``
  (fp32); the write strength is ``beta = sigmoid(b)``.
* ``out_norm.weight`` ``[d_v]``: the ``--normalization`` norm on each value head of the
  output, shared by the heads, then multiplied by ``silu(z)`` (the gated RMSNorm).
* ``out_proj.weight`` ``[hidden, H_v*d_v]`` (row-parallel). Neither projection has a bias,
  whatever ``--add-bias-linear`` says (as upstream).

Value head ``j`` reads query/key head ``j // (H_v / H_k)`` (Qwen3-Next's grouping). After
L2-normalizing q and k (eps 1e-6) and scaling q by ``d_k**-0.5``, each value head keeps a
``[d_k, d_v]`` state::

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,   o_t = S_t^T q_t

``chunk_gated_delta_rule`` computes it exactly in chunks of 64 tokens: inside a chunk the
written values solve a unit lower-triangular system (the WY form of the delta rule), the
chunks are chained through the state. Initialization: ``A_log = log(U(1, 16))``,
``dt_bias = 1``, the convolution ``U(-1/sqrt(K), 1/sqrt(K))`` (``nn.Conv1d``'s default, as
upstream), the projections Megatron's normal init (``out_proj`` scaled like ``linear_proj``).

Refused when the config is built: context parallelism, multi-latent attention alongside,
an activation other than silu (upstream's kernels take silu only), upstream's ``gdn2`` and
``dsa``. Refused in forward: an attention mask (the recurrence is causal over the whole
sequence; packed sequences are not supported). An MTP layer keeps softmax attention.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron.core.global_slices import partition, partition_sections
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from .layers import build_parallel_linear, output_init_std
from .norms import build_norm
from .recompute import recompute_saved, recomputes
from .transformer_config import TransformerConfig

CHUNK_SIZE = 64
A_INIT_RANGE = (1.0, 16.0)


def linear_attention_pattern(config) -> List[int]:
    """Per layer (0-based): 1 for a gated delta-net layer, 0 for softmax attention.

    Upstream's ``--linear-attention-freq``: an int N makes every N-th layer (N, 2N, ...,
    1-based) softmax attention and the others linear, a list is the pattern itself. Without
    a gated delta-net variant every layer is softmax attention."""
    if not is_gated_delta_net(getattr(config, "experimental_attention_variant", None)):
        return [0] * config.num_layers
    freq = config.linear_attention_freq
    if isinstance(freq, int) and not isinstance(freq, bool):
        return [0 if (i + 1) % freq == 0 else 1 for i in range(config.num_layers)]
    return [int(v) for v in freq]


def is_gated_delta_net(variant: Optional[str]) -> bool:
    return variant in ("gdn", "gated_delta_net")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's and Hugging Face's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = CHUNK_SIZE,
                           initial_state: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over [b, s, h, d] inputs (q, k already normalized and q scaled;
    g, beta [b, s, h]); returns the outputs [b, s, h, d_v] and the final state [b, h, d_k, d_v].
    Everything runs in fp32; the outputs come back in v's dtype.

    Per chunk of C tokens with state S0 at its start and G_t the cumulative sum of g inside it,
    the values actually written, u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t), satisfy
    (I + A) U = beta V - beta exp(G) K S0 with A[t, s] = beta_t exp(G_t - G_s) k_t.k_s for
    s < t; then O = (exp(G) Q) S0 + (Q K^T * exp(G_t - G_s))_{s <= t} U and
    S_C = exp(G_C) S0 + (exp(G_C - G) K)^T U. Padding tokens (beta = g = 0) write nothing."""
    # fp32 matmuls even under autocast (the state is chained over the whole sequence).
    with torch.autocast(q.device.type, enabled=False):
        return _chunk_gated_delta_rule(q, k, v, g, beta, chunk_size, initial_state)


def _chunk_gated_delta_rule(q, k, v, g, beta, chunk_size, initial_state):
    out_dtype = v.dtype
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))  # [b, h, s, d]
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))  # [b, h, s]
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    pad = (-s) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (s + pad) // chunk_size
    q, k, v = (x.reshape(b, h, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(b, h, n, chunk_size) for x in (g, beta))

    cum = g.cumsum(-1)  # G_t inside each chunk
    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # exp(G_t - G_s) for s <= t, zero above the diagonal (masked before exp: no overflow).
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()
    not_below = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(0)
    a_matrix = ((k @ k.transpose(-1, -2)) * decay * beta.unsqueeze(-1)).masked_fill(not_below, 0.0)
    system = a_matrix + torch.eye(chunk_size, dtype=q.dtype, device=q.device)  # I + A, unit lower-triangular
    k_beta_decayed = k * (beta * cum.exp()).unsqueeze(-1)
    # Intra-chunk parts that do not depend on the state: U = W - T_k S0 with W = (I + A)^-1 beta V.
    w = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    t_k = torch.linalg.solve_triangular(system, k_beta_decayed, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    end_decay = cum[..., -1].exp()

    state = (torch.zeros(b, h, dk, dv, dtype=torch.float32, device=q.device) if initial_state is None
             else initial_state.float())
    outputs = []
    for c in range(n):
        u = w[:, :, c] - t_k[:, :, c] @ state
        outputs.append(q_decayed[:, :, c] @ state + scores[:, :, c] @ u)
        state = state * end_decay[:, :, c, None, None] + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = torch.stack(outputs, dim=2).reshape(b, h, n * chunk_size, dv)[:, :, :s]
    return out.transpose(1, 2).to(out_dtype), state


class CausalConv1d(nn.Module):
    """Depthwise causal convolution over the channels of [b, s, C] (weight [C, 1, K], no bias),
    then SiLU. ``global_slices`` (set by the owner) says which global channels a TP rank has."""

    def __init__(self, channels: int, kernel_size: int, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, dtype=dtype))
        self.reset_parameters()

    def initialize_global_(self, attr: str, values: torch.Tensor, generator: torch.Generator) -> None:
        bound = 1.0 / math.sqrt(self.kernel_size)  # nn.Conv1d's default (fan_in = K for a depthwise conv)
        values.uniform_(-bound, bound, generator=generator)

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.kernel_size)
        with torch.no_grad():
            nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        out = F.conv1d(x.transpose(1, 2), self.weight, padding=self.kernel_size - 1, groups=self.weight.shape[0])
        return F.silu(out[..., :s]).transpose(1, 2)

    def extra_repr(self) -> str:
        return f"channels={self.weight.shape[0]}, kernel_size={self.kernel_size}"


class GatedDeltaNet(nn.Module):
    def __init__(self, config: TransformerConfig, layer_number: int = 1):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        tp = config.tensor_model_parallel_size
        rank = 0 if tp == 1 else torch.distributed.get_rank(config.tp_group)
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        self.num_key_heads = config.linear_num_key_heads // tp  # this rank's
        self.num_value_heads = config.linear_num_value_heads // tp
        self.heads_per_key = config.linear_num_value_heads // config.linear_num_key_heads
        qk, vv, nv = (config.linear_key_head_dim * config.linear_num_key_heads,
                      config.linear_value_head_dim * config.linear_num_value_heads, config.linear_num_value_heads)
        sections = (qk, qk, vv, vv, nv, nv)
        # No biases whatever --add-bias-linear says (upstream builds GatedDeltaNet with bias=False).
        self.in_proj = build_parallel_linear(config, config.hidden_size, sum(sections), bias=False,
                                             init_std=config.hidden_init_std, split="column", sections=sections)
        self.conv1d = CausalConv1d((2 * qk + vv) // tp, config.linear_conv_kernel_dim, dtype=config.params_dtype)
        self.A_log = nn.Parameter(torch.empty(nv // tp, dtype=config.params_dtype))
        self.dt_bias = nn.Parameter(torch.empty(nv // tp, dtype=config.params_dtype))
        if tp > 1:
            self.conv1d.global_slices = {"weight": partition_sections(
                (2 * qk + vv, 1, config.linear_conv_kernel_dim), 0, rank, tp, (qk, qk, vv))}
            self.global_slices = {name: partition((nv,), 0, rank, tp) for name in ("A_log", "dt_bias")}
            # Split over TP (finalize_grads: not summed over TP, counted once by the clipping).
            self.conv1d.tensor_parallel_split = ("weight",)
            self.tensor_parallel_split = ("A_log", "dt_bias")
        self.out_norm = build_norm(config, self.value_head_dim)
        # A rank's out_norm gradient covers its own heads only: without sequence parallelism
        # (which sums replicated gradients in finalize_grads) the weight goes through
        # copy_to_tensor_model_parallel_region, whose backward sums it over TP.
        self.norm_group = config.tp_group if tp > 1 and not config.sequence_parallel else None
        self.out_proj = build_parallel_linear(config, vv, config.hidden_size, bias=False,
                                              init_std=output_init_std(config), split="row")
        self.recompute_norm_out = recomputes(config, "gdn_norm_out")
        self.reset_parameters()

    def initialize_global_(self, attr: str, values: torch.Tensor, generator: torch.Generator) -> None:
        if attr == "A_log":
            values.uniform_(*A_INIT_RANGE, generator=generator).log_()
        elif attr == "dt_bias":
            values.fill_(1.0)
        else:
            raise ValueError(f"GatedDeltaNet has no initialization rule for {attr!r}.")

    def reset_parameters(self) -> None:
        """A_log and dt_bias (the children initialize themselves)."""
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32).uniform_(*A_INIT_RANGE).log())
            self.dt_bias.fill_(1.0)

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """norm(core) * silu(z) per value head, [b, s, heads, d_v] -> [b, s, heads * d_v]."""
        if self.norm_group is None:
            normed = self.out_norm(core)
        else:
            params = {name: copy_to_tensor_model_parallel_region(p, self.norm_group)
                      for name, p in self.out_norm.named_parameters(recurse=False)}
            normed = torch.func.functional_call(self.out_norm, params, (core,))
        out = (normed * F.silu(z.float())).to(core.dtype)
        return out.flatten(2)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb=None) -> torch.Tensor:
        """hidden_states [b, s, h] (a sequence chunk under sequence parallelism) -> same shape.
        No position embedding: the recurrence is ordered; ``rotary_pos_emb`` is ignored."""
        if attention_mask is not None:
            raise ValueError("the gated delta net is causal over the whole sequence and takes no attention mask; "
                             "pass attention_mask=None (the causal mask) for hybrid linear-attention models.")
        mixed = self.in_proj(hidden_states)
        b, s, _ = mixed.shape
        qk, vv, nv = (self.num_key_heads * self.key_head_dim, self.num_value_heads * self.value_head_dim,
                      self.num_value_heads)
        qkv, z, beta_in, a = torch.split(mixed, [2 * qk + vv, vv, nv, nv], dim=-1)
        qkv = self.conv1d(qkv)
        q, k, v = torch.split(qkv, [qk, qk, vv], dim=-1)
        q = l2norm(q.reshape(b, s, self.num_key_heads, self.key_head_dim).float())
        k = l2norm(k.reshape(b, s, self.num_key_heads, self.key_head_dim).float())
        if self.heads_per_key > 1:
            q = q.repeat_interleave(self.heads_per_key, dim=2)
            k = k.repeat_interleave(self.heads_per_key, dim=2)
        q = q * self.key_head_dim ** -0.5
        v = v.reshape(b, s, nv, self.value_head_dim)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        beta = torch.sigmoid(beta_in.float())
        core, _ = chunk_gated_delta_rule(q, k, v, g, beta)
        z = z.reshape(b, s, nv, self.value_head_dim)
        if self.recompute_norm_out and self.training and torch.is_grad_enabled():
            # Upstream's "gdn_norm_out": the gated norm's output is not kept for out_proj.
            normed = self._gated_norm(core, z)
            with recompute_saved(normed, lambda: self._gated_norm(core, z)):
                return self.out_proj(normed)
        return self.out_proj(self._gated_norm(core, z))
