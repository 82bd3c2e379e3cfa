"""The gated linear unit over ``linear_fc1``'s output ``[..., 2 * ffn]`` (gate rows, then up
rows: mlp.py), shared by the dense MLP and the experts.

Plain SwiGLU (silu, no GPT-OSS offset or clamp) runs as one autograd function: its backward
writes both halves' gradients into one ``[..., 2 * ffn]`` tensor, where the composition
``silu(gate) * up`` over ``chunk`` leaves autograd to concatenate them (a copy of the whole
gradient, the largest activation gradient of the layer). Forward and backward call the
operators autograd would, so the bits are the same (tests/unit_tests/transformer/
test_swiglu.py). Every other gated unit, and any under torch.compile, goes through
``gpt_oss.gated_activation``.
"""

import torch
import torch.nn.functional as F

from .gpt_oss import gated_activation


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, intermediate: torch.Tensor) -> torch.Tensor:
        half = intermediate.shape[-1] // 2
        activated = F.silu(intermediate[..., :half])
        ctx.save_for_backward(intermediate, activated)
        return activated * intermediate[..., half:]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        intermediate, activated = ctx.saved_tensors
        half = intermediate.shape[-1] // 2
        grad_input = torch.empty(intermediate.shape, dtype=grad.dtype, device=grad.device)
        # d/d gate: silu'(gate) * (grad * up); d/d up: grad * silu(gate) (autograd's mul and silu formulas).
        torch.ops.aten.silu_backward.grad_input(grad * intermediate[..., half:], intermediate[..., :half],
                                                grad_input=grad_input[..., :half])
        torch.mul(grad, activated, out=grad_input[..., half:])
        return grad_input


def is_plain_swiglu(config) -> bool:
    return (config.activation is F.silu and not config.glu_linear_offset
            and config.activation_func_clamp_value is None)


def gated_linear_unit(config, intermediate: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` for fc1's output ``[..., 2 * ffn]``, as the config's gated unit."""
    # Under torch.compile the composition is traced instead: inductor fuses it into one kernel
    # anyway, and dynamo refuses the strided ``out=`` of the eager backward.
    if is_plain_swiglu(config) and not torch.compiler.is_compiling():
        return _SwiGLU.apply(intermediate)
    gate, up = intermediate.chunk(2, dim=-1)
    return gated_activation(config, gate, up)
