"""Rotary position embeddings (RoPE), in the "rotate half" form used by Megatron-LM and
Hugging Face Llama, or interleaved (--rotary-interleaved).

Rotate half: each head vector of size d is split into halves (x1 = x[:d/2], x2 = x[d/2:]);
dimension i of the first half is rotated together with dimension i of the second half by
the angle ``position * rotary_base ** (-2i / d)``. Because Megatron and Hugging Face Llama
both use this layout, q/k projection rows convert between them without any permutation.

Interleaved (GPT-J, Meta's original Llama): dimensions 2i and 2i + 1 form the pair rotated
by that same angle, as if they were the real and imaginary part of one complex number.
"""

from typing import Optional, Tuple

import torch
import torch.nn as nn


class RotaryTables(tuple):
    """(cos, sin), each [b, s, r], plus the pair layout they were built for, so that the
    attention applies them without being told the layout separately."""

    interleaved: bool

    def __new__(cls, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False):
        tables = super().__new__(cls, (cos, sin))
        tables.interleaved = interleaved
        return tables


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) tables for given position ids.

    Holds no parameters or buffers: the inverse frequencies are recomputed per forward
    (a few hundred flops), so nothing needs materializing after a meta-device build and
    nothing can be sharded or cast to bf16 by accident.
    """

    def __init__(self, kv_channels: int, rotary_base: float = 10000, interleaved: bool = False):
        super().__init__()
        if kv_channels % 2 != 0:
            raise ValueError(f"rotary embeddings need an even head dimension, got {kv_channels}.")
        self.kv_channels = kv_channels
        self.rotary_base = rotary_base
        self.interleaved = interleaved

    def forward(self, position_ids: torch.Tensor) -> RotaryTables:
        """position_ids [b, s] -> (cos, sin), each [b, s, kv_channels] in fp32."""
        exponent = torch.arange(0, self.kv_channels, 2, device=position_ids.device, dtype=torch.float32)
        inv_freq = 1.0 / (self.rotary_base ** (exponent / self.kv_channels))
        angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq  # [b, s, d/2]
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)  # same angle for dims 2i and 2i + 1
        else:
            angles = torch.cat((angles, angles), dim=-1)  # same angle for dims i and i + d/2
        return RotaryTables(angles.cos(), angles.sin(), self.interleaved)

    def extra_repr(self) -> str:
        return f"kv_channels={self.kv_channels}, rotary_base={self.rotary_base}, interleaved={self.interleaved}"


def _rotate_half(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """The partner of each dimension, negated where the rotation subtracts it."""
    if interleaved:
        # (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, rotary_pos_emb: Tuple[torch.Tensor, torch.Tensor],
                         interleaved: Optional[bool] = None) -> torch.Tensor:
    """Rotate x [b, s, heads, d] by (cos, sin) [b, s, r]. Computed in fp32, returned in x's
    dtype. With r < d (``rotary_percent`` < 1) only the first r dimensions are rotated and
    the others pass through unchanged, as in Megatron-LM. The pair layout is the tables'
    (``RotaryTables.interleaved``) unless ``interleaved`` is given."""
    if interleaved is None:
        interleaved = getattr(rotary_pos_emb, "interleaved", False)
    cos, sin = rotary_pos_emb
    cos = cos.unsqueeze(2)  # broadcast over heads
    sin = sin.unsqueeze(2)
    rotary_dim = cos.shape[-1]
    x32 = x.float()
    rotated, passed = x32[..., :rotary_dim], x32[..., rotary_dim:]
    rotated = rotated * cos + _rotate_half(rotated, interleaved) * sin
    return torch.cat((rotated, passed), dim=-1).to(x.dtype)
