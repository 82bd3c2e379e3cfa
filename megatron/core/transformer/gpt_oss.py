"""GPT-OSS's blocks, with Megatron-LM's semantics (its TransformerConfig fields).

* Attention sinks (``softmax_type``): ``"vanilla"`` is the plain softmax. ``"off-by-one"``
  adds a fixed logit 0 to every row's softmax denominator, ``"learnable"`` a learnable
  logit per head (``softmax_offset``, one per query head, split over TP with the heads):
  ``p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))``. The sink takes part in the
  normalization only; it has no value, so the probabilities of a row sum to less than one.
  SDPA cannot add it: ``sink_attention`` computes the scores explicitly with the sink as an
  extra column of the softmax (a fully masked row then attends to nothing: output 0).
* Sliding-window attention (``window_size = (L, R)``): query ``i`` sees key ``j`` iff
  ``i - L <= j <= i + R`` (upstream's ``get_sliding_window_causal_mask``; keys and queries
  aligned at the end when their lengths differ). GPT attention is causal, so R must be 0
  (Transformer Engine, upstream's path, forces it so for causal masks); L = -1: no left
  limit. ``window_attn_skip_freq`` picks the window layers as upstream's
  ``is_layer_window_attention``: None: every layer; an int N: all but every N-th layer
  (layer numbers from 1); a 0/1 list per layer, 1 = window (full past its end: MTP layers).
* Quick-GEGLU (``activation_func`` "quick_gelu" with a gated unit): ``quick_gelu(x) =
  x * sigmoid(1.702 x)`` on the gate; ``gated_activation`` adds ``glu_linear_offset`` to the
  linear half and, with ``activation_func_clamp_value`` c, first clamps the gate to
  ``<= c`` and the linear half to ``[-c, c]`` (upstream's order).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """The sigmoid approximation of GELU."""
    return x * torch.sigmoid(1.702 * x)


def gated_activation(config, gate: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
    """A gated unit's ``act(gate) * (linear + offset)``, both halves clamped first when
    ``activation_func_clamp_value`` is set (upstream's gated units, dense and experts)."""
    clamp = config.activation_func_clamp_value
    if clamp is not None:
        gate = gate.clamp(max=clamp)
        linear = linear.clamp(min=-clamp, max=clamp)
    offset = config.glu_linear_offset
    return config.activation(gate) * (linear + offset if offset else linear)


def is_window_layer(window_size: Optional[Tuple[int, int]], skip_freq: Union[None, int, List[int]],
                    layer_number: int) -> bool:
    """Whether layer ``layer_number`` (from 1) uses the sliding window (upstream's rule)."""
    if not window_size:
        return False
    if skip_freq is None:
        return True
    if isinstance(skip_freq, int):
        return layer_number % skip_freq != 0
    # Past the list (a multi-token prediction layer): full attention.
    return layer_number <= len(skip_freq) and bool(skip_freq[layer_number - 1])


def window_allowed(q_len: int, k_len: int, window_size: Tuple[int, int], device) -> torch.Tensor:
    """[q_len, k_len] bool, True where query i may see key j under the window (L = -1: no left limit)."""
    left, right = window_size
    offset = torch.arange(k_len, device=device)[None, :] - torch.arange(q_len, device=device)[:, None] \
        - (k_len - q_len)  # j - i, keys aligned with the queries at the end
    allowed = offset <= right
    if left >= 0:
        allowed &= offset >= -left
    return allowed


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor],
                   sink: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax over [scores, sink] without the sink's column, times v.

    q [b, H, sq, d], k and v [b, G, sk, d] (query head h uses kv head h // (H / G));
    ``allowed`` bool broadcastable to [b, H, sq, sk] (True: attend) or None (all);
    ``sink`` [H], the per-head sink logit. Scores and softmax in fp32, scale 1 / sqrt(d)."""
    heads, groups = q.shape[1], k.shape[1]
    if heads != groups:
        k = k.repeat_interleave(heads // groups, dim=1)
        v = v.repeat_interleave(heads // groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    sink_column = sink.float().view(1, heads, 1, 1).expand(scores.shape[0], heads, scores.shape[2], 1)
    probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(v.dtype), v)
