"""LayerNorm and RMSNorm, and ``build_norm`` which picks the implementation.

Parameter names are ``weight`` (and ``bias`` for LayerNorm) in every implementation
(local, apex, Transformer Engine), so checkpoints do not depend on the backend.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from .backends import apex_norm_class, import_transformer_engine, te_device
from .transformer_config import TransformerConfig


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension with affine weight (init 1) and bias (init 0).

    ``zero_centered_gamma`` (Megatron's ``--apply-layernorm-1p``): the parameter stores
    ``gamma - 1``, initialized to 0, and the forward multiplies by ``weight + 1``. Weight
    decay then pulls gamma towards 1 instead of 0.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32,
                 zero_centered_gamma: bool = False):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            (nn.init.zeros_ if self.zero_centered_gamma else nn.init.ones_)(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return F.layer_norm(x, (self.hidden_size,), weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}" + (", zero-centered gamma" if self.zero_centered_gamma else "")


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``x / sqrt(mean(x^2) + eps) * weight``.

    The statistics are computed in fp32 even for bf16 inputs (a bf16 mean of squares loses
    too much precision); the normalized value is cast back before the weight multiply, the
    same order as Llama's reference implementation. ``zero_centered_gamma``: as LayerNorm's
    (upstream's Llama-3 scripts pass --apply-layernorm-1p with RMSNorm; TE's RMSNorm has it).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32,
                 zero_centered_gamma: bool = False):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            (nn.init.zeros_ if self.zero_centered_gamma else nn.init.ones_)(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return normed.to(x.dtype) * weight

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}" + (", zero-centered gamma" if self.zero_centered_gamma else "")


def build_norm(config: TransformerConfig, hidden_size: int) -> nn.Module:
    """The norm the config asks for: TE's (transformer_impl='transformer_engine'), apex's
    fused one (use_apex_fused=True and apex importable), else the local one."""
    if config.transformer_impl == "transformer_engine":
        te = import_transformer_engine()
        te_class = te.LayerNorm if config.normalization == "LayerNorm" else te.RMSNorm
        extra = {"zero_centered_gamma": True} if config.apply_layernorm_1p else {}
        return te_class(hidden_size, eps=config.layernorm_epsilon, params_dtype=config.params_dtype,
                        device=te_device(), **extra)
    if config.apply_layernorm_1p:  # apex's fused norms have no zero-centered gamma
        local_class = LayerNorm if config.normalization == "LayerNorm" else RMSNorm
        return local_class(hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype,
                           zero_centered_gamma=True)
    if config.use_apex_fused:
        apex_class = apex_norm_class(config.normalization)
        if apex_class is not None:
            # apex allocates fp32 parameters; cast them to the model's parameter dtype.
            return apex_class(hidden_size, eps=config.layernorm_epsilon).to(dtype=config.params_dtype)
    local_class = LayerNorm if config.normalization == "LayerNorm" else RMSNorm
    return local_class(hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype)
