"""World-size-invariant initialization: every parameter from its own seeded generator.

``initialize_parameters_(model, seed)`` draws each parameter from a CPU generator seeded
by ``(seed, fully-qualified name)``, with Megatron's distributions:

* weights of ``Linear`` / ``Embedding`` / the output layer: normal(0, ``init_std`` of the
  module), which is ``init_method_std`` or, for the projections that write into the
  residual stream (``linear_proj``, ``linear_fc2``), ``init_method_std / sqrt(2 * num_layers)``;
* norm weights one, biases zero;
* a module with its own rule (the gated delta net's ``A_log``, ``dt_bias`` and causal
  convolution) fills its global tensor in ``initialize_global_(attr, values, generator)``.

A parameter that is a piece of a larger global tensor (tensor or expert parallelism, see
``megatron/core/global_slices.py``) is drawn at its global shape and cut to this rank's
piece, so every layout holds pieces of the same global weights.

A parameter's values then depend on nothing but the seed and its name: not on the order
in which modules are built or visited, the world size, the sharding strategy, the device,
or whether the model was built on ``meta``. A sharded model initializes one unit at a
time by passing each unit's name as ``prefix`` (and skipping nested units with
``stop_at``), and gets bitwise the weights of an unsharded model.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Optional

import torch
import torch.nn as nn

from megatron.core.global_slices import global_slices_of


def parameter_seed(seed: int, fqn: str) -> int:
    """A stable 63-bit seed for parameter ``fqn`` (Python's ``hash`` is salted per process)."""
    digest = hashlib.sha256(f"{int(seed)}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _is_norm(module: nn.Module) -> bool:
    # Local LayerNorm/RMSNorm, apex's Fused*Norm and TE's LayerNorm/RMSNorm.
    return type(module).__name__.endswith("Norm")


def _fill(module: nn.Module, attr: str, fqn: str, values: torch.Tensor, generator: torch.Generator) -> None:
    own_rule = getattr(module, "initialize_global_", None)
    if own_rule is not None:
        own_rule(attr, values, generator)
    elif attr == "bias":
        values.zero_()
    elif _is_norm(module):
        values.fill_(1.0)
    elif hasattr(module, "init_std"):
        values.normal_(0.0, module.init_std, generator=generator)
    else:
        raise ValueError(
            f"no Megatron initialization rule for parameter '{fqn}' of {type(module).__name__}: give the "
            "module an `init_std` attribute (normal(0, init_std) weights, zero bias), or name it *Norm."
        )


def initialize_parameters_(root: nn.Module, seed: int, prefix: str = "",
                           stop_at: Optional[Callable[[nn.Module], bool]] = None) -> None:
    """Fill every parameter under ``root`` in place (see the module docstring).

    ``prefix`` is ``root``'s fully-qualified name in the whole model (with its trailing
    dot), so names match those of the unsharded model; submodules for which
    ``stop_at(module)`` is true are not entered (e.g. nested FSDP units, initialized on
    their own). A tied parameter is filled once, under its first name."""
    seen = set()
    stack = [(prefix, root)]
    with torch.no_grad():
        while stack:
            name, module = stack.pop()
            for attr, param in module._parameters.items():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                fqn = name + attr
                generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, fqn))
                # Drawn in fp32 on the CPU: the same bits for every device and parameter dtype.
                piece = global_slices_of(module).get(attr)
                values = torch.empty(param.shape if piece is None else piece.global_shape, dtype=torch.float32)
                _fill(module, attr, fqn, values, generator)
                param.copy_(values if piece is None else piece.take(values))
            for child_name, child in reversed(list(module._modules.items())):
                if child is not None and not (stop_at is not None and stop_at(child)):
                    stack.append((f"{name}{child_name}.", child))
