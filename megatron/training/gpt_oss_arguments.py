"""Megatron-LM's GPT-OSS block flags: parsing and parse-time checks.

Names, defaults and meanings are upstream's (megatron/training/arguments.py, its
TransformerConfig): ``--softmax-type vanilla|off-by-one|learnable`` (attention sinks),
``--window-size L,R`` and ``--window-attn-skip-freq`` (sliding-window layers: an int N keeps
every N-th layer full, or a list expression of 0/1 per layer, 1 = window), ``--quick-geglu``
(a gated unit with quick-GELU), ``--glu-linear-offset`` and ``--activation-func-clamp-value``.
The blocks are ``megatron/core/transformer/gpt_oss.py``; ``validate_gpt_oss_args`` runs the
config's own checks, so a bad combination fails before any process group exists.
(``--enable-gpt-oss`` and ``--export-force-local-attention`` are ModelOpt's: megatron_compat.py.)
"""

from __future__ import annotations

import argparse
import ast
import types

from megatron.core.transformer.gpt_oss import SOFTMAX_TYPES
from megatron.core.transformer.moe.config import _evaluate
from megatron.core.transformer.transformer_config import TransformerConfig


def parse_window_size(text):
    """Upstream's ``tuple_type``: "L,R" (parentheses allowed) -> (L, R)."""
    try:
        values = tuple(int(x) for x in str(text).strip().strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window-size {text!r} is not two ints; write e.g. 127,0.") from None
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"--window-size {text!r} is not two ints; write e.g. 127,0.")
    return values


def parse_window_attn_skip_freq(text):
    """Upstream's ``moe_freq_type``: an int, or a list expression of 0/1 (only list/int
    literals, ``+`` and ``*`` are evaluated)."""
    text = str(text).strip()
    try:
        value = int(text) if "[" not in text else _evaluate(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"--window-attn-skip-freq {text!r} is not an int or a list of 0/1; "
                                         "write e.g. 2 or '[1,0]*6'.") from None
    if not isinstance(value, (int, list)):
        raise argparse.ArgumentTypeError(f"--window-attn-skip-freq {text!r} must give an int or a list of 0/1.")
    return value


def add_gpt_oss_args(group) -> None:
    group.add_argument("--softmax-type", choices=SOFTMAX_TYPES, default="vanilla",
                       help="attention sinks: off-by-one adds a 0 logit to each softmax denominator, learnable "
                            "a learned logit per head")
    group.add_argument("--window-size", type=parse_window_size, default=None,
                       help="L,R: sliding-window attention, query i sees keys i-L..i+R (R must be 0: causal)")
    group.add_argument("--window-attn-skip-freq", type=parse_window_attn_skip_freq, default=None,
                       help="N: every N-th layer full attention, the others windowed; or a 0/1 list per layer "
                            "(1 = window). Default: every layer windowed")
    group.add_argument("--quick-geglu", action="store_true",
                       help="gated MLP with quick-GELU x*sigmoid(1.702x) on the gate (GPT-OSS)")
    group.add_argument("--glu-linear-offset", type=float, default=0.0,
                       help="added to the gated unit's linear half: act(gate) * (linear + offset)")
    group.add_argument("--activation-func-clamp-value", type=float, default=None,
                       help="clamp the gated unit's gate to <= c and its linear half to [-c, c]")


def gpt_oss_config_kwargs(args) -> dict:
    """The ``TransformerConfig`` fields (getattr: argument sets saved before these flags
    existed mean the plain blocks)."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    return dict(softmax_type=get("softmax_type", "vanilla"), window_size=get("window_size"),
                window_attn_skip_freq=get("window_attn_skip_freq"),
                glu_linear_offset=get("glu_linear_offset", 0.0),
                activation_func_clamp_value=get("activation_func_clamp_value"))


def validate_gpt_oss_args(args: argparse.Namespace) -> None:
    """The config's GPT-OSS checks (ValueError with the fix), at parse time."""
    if getattr(args, "quick_geglu", False) and (args.swiglu or getattr(args, "squared_relu", False)):
        raise ValueError("--quick-geglu and --swiglu/--squared-relu all choose the MLP activation; pass one of them.")
    fields = gpt_oss_config_kwargs(args)
    fields.update(num_layers=args.num_layers, gated_linear_unit=args.swiglu or getattr(args, "quick_geglu", False),
                  context_parallel_size=getattr(args, "context_parallel_size", 1),
                  multi_latent_attention=getattr(args, "multi_latent_attention", False))
    config = types.SimpleNamespace(**fields)
    TransformerConfig._check_gpt_oss(config)
    args.window_size = config.window_size
