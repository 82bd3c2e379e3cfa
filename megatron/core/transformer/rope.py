"""Rotary position embeddings (RoPE), in the "rotate half" form used by Megatron-LM and
Hugging Face Llama, or interleaved (--rotary-interleaved).

Rotate half: each head vector of size d is split into halves (x1 = x[:d/2], x2 = x[d/2:]);
dimension i of the first half is rotated together with dimension i of the second half by
the angle ``position * rotary_base ** (-2i / d)``. Because Megatron and Hugging Face Llama
both use this layout, q/k projection rows convert between them without any permutation.

Interleaved (GPT-J, Meta's original Llama): dimensions 2i and 2i + 1 form the pair rotated
by that same angle, as if they were the real and imaginary part of one complex number.

YaRN (``--position-embedding-type yarn``, https://arxiv.org/abs/2309.00071; Megatron-LM's
``YarnRotaryEmbedding``, DeepSeek-V3's rotary embedding): each frequency is blended between
its original value (pairs that turn many times over the original context: extrapolated) and
the value divided by the scaling factor s (slow pairs: interpolated), with a linear ramp
between the dimensions that turn ``beta_fast`` and ``beta_slow`` times over
``original_max_position_embeddings``; cos and sin are multiplied by the concentration
factor ``m(s, mscale) / m(s, mscale_all_dim)``, ``m(s, a) = 0.1 a ln s + 1`` (1 for s <= 1).
"""

import dataclasses
import math
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


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN's parameters, with Megatron-LM's defaults (its ``YarnRotaryEmbedding``)."""

    scaling_factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    correction_range_round_to_int: bool = True

    def __post_init__(self):
        if not self.scaling_factor > 0:
            raise ValueError(f"YaRN's scaling factor must be positive, got {self.scaling_factor}.")
        if not self.original_max_position_embeddings > 0:
            raise ValueError("YaRN's original max position embeddings must be positive, got "
                             f"{self.original_max_position_embeddings}.")
        if not self.beta_fast > 0 or not self.beta_slow > 0:
            raise ValueError(f"YaRN's beta_fast and beta_slow must be positive, got {self.beta_fast}, {self.beta_slow}.")

    def _correction_dim(self, rotations: float, dim: int, base: float) -> float:
        """The dimension whose pair turns ``rotations`` times over the original context."""
        return dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    def inverse_frequencies(self, dim: int, base: float, device=None) -> torch.Tensor:
        """[dim / 2] fp32: the blend of the original and the interpolated frequencies."""
        low = self._correction_dim(self.beta_fast, dim, base)
        high = self._correction_dim(self.beta_slow, dim, base)
        if self.correction_range_round_to_int:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # a ramp of zero width would divide by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        extrapolated = 1.0 - ramp  # 1 for the fast pairs: keep their frequency
        powers = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
        return (1.0 / (self.scaling_factor * powers)) * (1 - extrapolated) + (1.0 / powers) * extrapolated

    def concentration(self) -> float:
        """The factor on cos and sin (attention scores scale by its square)."""
        def m(a):
            return 1.0 if self.scaling_factor <= 1 else 0.1 * a * math.log(self.scaling_factor) + 1.0
        return float(m(self.mscale) / m(self.mscale_all_dim))


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) tables for given position ids.

    Holds no parameters or buffers: the inverse frequencies are recomputed per forward
    (a few hundred flops), so nothing needs materializing after a meta-device build and
    nothing can be sharded or cast to bf16 by accident.
    """

    def __init__(self, kv_channels: int, rotary_base: float = 10000, interleaved: bool = False,
                 yarn: Optional[YarnScaling] = None):
        super().__init__()
        if kv_channels % 2 != 0:
            raise ValueError(f"rotary embeddings need an even head dimension, got {kv_channels}.")
        if yarn is not None and interleaved:
            raise ValueError("YaRN rotates halves (as Megatron-LM and DeepSeek-V3); drop --rotary-interleaved.")
        self.kv_channels = kv_channels
        self.rotary_base = rotary_base
        self.interleaved = interleaved
        self.yarn = yarn

    def forward(self, position_ids: torch.Tensor) -> RotaryTables:
        """position_ids [b, s] -> (cos, sin), each [b, s, kv_channels] in fp32."""
        if self.yarn is not None:
            inv_freq = self.yarn.inverse_frequencies(self.kv_channels, self.rotary_base, position_ids.device)
        else:
            exponent = torch.arange(0, self.kv_channels, 2, device=position_ids.device, dtype=torch.float32)
            inv_freq = 1.0 / (self.rotary_base ** (exponent / self.kv_channels))
        angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq  # [b, s, d/2]
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)  # same angle for dims 2i and 2i + 1
        else:
            angles = torch.cat((angles, angles), dim=-1)  # same angle for dims i and i + d/2
        cos, sin = angles.cos(), angles.sin()
        if self.yarn is not None:
            factor = self.yarn.concentration()
            cos, sin = cos * factor, sin * factor
        return RotaryTables(cos, sin, self.interleaved)

    def extra_repr(self) -> str:
        yarn = f", yarn={self.yarn}" if self.yarn is not None else ""
        return (f"kv_channels={self.kv_channels}, rotary_base={self.rotary_base}, "
                f"interleaved={self.interleaved}{yarn}")


def _rotate_half(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """The partner of each dimension, negated where the rotation subtracts it."""
    if interleaved:
        # (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x [..., d] fp32 rotated by (cos, sin) [..., r] in the rotate-half layout; dims past r
    pass through. Forward: (x1 c1 - x2 s1, x2 c2 + x1 s2); ``inverse`` (the backward, the
    transposed rotation): (x1 c1 + x2 s2, x2 c2 - x1 s1). Each product is rounded as in
    ``x * cos + _rotate_half(x) * sin`` and a sum of two terms does not depend on their
    order, so these are that composition's bits, forward and backward."""
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    if rotary_dim == x.shape[-1]:
        out = x * cos
    else:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        torch.mul(x[..., :rotary_dim], cos, out=out[..., :rotary_dim])
        out[..., rotary_dim:] = x[..., rotary_dim:]
    if inverse:
        out[..., :half] += x2 * sin[..., half:]
        out[..., half:rotary_dim] -= x1 * sin[..., :half]
    else:
        out[..., :half] -= x2 * sin[..., :half]
        out[..., half:rotary_dim] += x1 * sin[..., half:]
    return out


class _RotateHalves(torch.autograd.Function):
    """RoPE in the rotate-half layout without the composition's temporaries (the partner's
    ``cat``, its negation, the zero-filled slice gradients): three full-size passes over the
    tensor where the composition writes five or six, the same bits
    (tests/unit_tests/transformer/test_rope_halves.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate_halves(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate_halves(grad, cos, sin, inverse=True), None, None


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
    x32 = x.float()
    # torch.compile traces the composition, which inductor fuses (its own bits either way).
    if not interleaved and not (cos.requires_grad or sin.requires_grad or torch.compiler.is_compiling()):
        return _RotateHalves.apply(x32, cos, sin).to(x.dtype)
    return _rotate_composed(x32, cos, sin, interleaved).to(x.dtype)


def _rotate_composed(x32: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotation as a composition of tensor operations: any layout, differentiable in the
    tables too; the reference of ``_RotateHalves``."""
    rotary_dim = cos.shape[-1]
    rotated, passed = x32[..., :rotary_dim], x32[..., rotary_dim:]
    rotated = rotated * cos + _rotate_half(rotated, interleaved) * sin
    return torch.cat((rotated, passed), dim=-1)
