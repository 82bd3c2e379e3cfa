"""``--compile-layers``: ``torch.compile`` of every transformer layer's forward.

torchtitan's ``--compile`` semantics: each block is compiled on its own (one graph per
layer, ``fullgraph=True``, so a graph break is an error rather than a slow path), and the
data-parallel engine's hooks stay eager. Here the compiled function is the layer's
``forward`` only: ``nn.Module.__call__`` still runs the MFSDP hooks (unshard, prefetch,
reshard before and after; the pre-backward hooks it puts on the outputs; the gradient
hooks of the parameters) in Python around it, exactly as without the flag. Compiling
``layer.__call__`` (``nn.Module.compile``) would trace those hooks too.

Why it needs no recompile per step: dynamo treats the layer's parameters as graph inputs
(guards on dtype, shape, strides and ``requires_grad``, not on identity or storage), and
the engine swaps in the same unsharded ``nn.Parameter`` objects every step, whose storage
it allocates and frees. Every layer of one kind shares one graph (same code, same shapes).
Evaluation (no grad) compiles a second graph, once.

Inside a compiled layer the fused weight-gradient accumulation gives way to autograd's
own gradient (``grad_accumulation_fusion.linear`` asks ``torch.compiler.is_compiling()``):
its backward writes into the engine's buffer, a side effect a graph cannot hold; the
engine's gradient hook copies the gradient there instead (the same values).

Refused (parse time), each for a reason checked on this CPU: context parallelism (its
attention is a hand-written ring of point-to-point exchanges), mixture of experts (token
counts per expert change every step: data-dependent shapes), and the selective-recompute
modules that discard an output through saved-tensor hooks (``layernorm``, ``moe_act``,
``gdn_norm_out``: dynamo does not trace ``saved_tensors_hooks``). Dropout runs inside the
graph with the compiler's random-number kernels: its masks are drawn differently from
eager's (same distribution; compiled and eager runs with dropout do not match bit for bit).
"""

from __future__ import annotations

import argparse
from typing import Iterable, List

import torch

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
# Selective-recompute modules implemented with saved-tensor hooks (recompute.recompute_saved).
_SAVED_TENSOR_HOOK_MODULES = ("layernorm", "moe_act", "gdn_norm_out")


def add_compile_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("torch.compile")
    g.add_argument("--compile-layers", nargs="?", const="inductor", default=None, choices=COMPILE_BACKENDS,
                   metavar="BACKEND",
                   help="torch.compile each transformer layer's forward (the data-parallel hooks stay eager), "
                        "as torchtitan's --compile; BACKEND: inductor (default), aot_eager or eager")


def validate_compile_args(args: argparse.Namespace) -> None:
    """Refuse what compiled layers cannot run correctly or without recompiling every step."""
    if args.compile_layers is None:
        return
    if getattr(args, "context_parallel_size", 1) > 1:
        raise ValueError("--compile-layers does not support --context-parallel-size > 1 (the context-parallel "
                         "attention exchanges keys and values point to point inside the layer); drop "
                         "--compile-layers or use --context-parallel-size 1.")
    if getattr(args, "num_experts", None):
        raise ValueError("--compile-layers does not support MoE layers (--num-experts): the tokens per expert "
                         "change every step, so the graph would recompile; drop --compile-layers.")
    modules = getattr(args, "recompute_modules", None) or []
    hooked = [m for m in modules if m in _SAVED_TENSOR_HOOK_MODULES]
    if args.recompute_granularity == "selective" and hooked:
        raise ValueError(f"--compile-layers cannot compile --recompute-modules {' '.join(hooked)} (it discards "
                         "the output through saved-tensor hooks, which torch.compile does not trace); drop "
                         "them from the list (core_attn and mlp compile) or drop --compile-layers.")


def compile_layers(layers: Iterable[torch.nn.Module], backend: str) -> List[torch.nn.Module]:
    """Replace each layer's ``forward`` by its compiled version (in place; hooks untouched)."""
    layers = list(layers)
    for layer in layers:
        # An attribute of the layer object, not of torch: __call__ runs the hooks, then this.
        layer.forward = torch.compile(layer.forward, backend=backend, fullgraph=True)
    return layers
