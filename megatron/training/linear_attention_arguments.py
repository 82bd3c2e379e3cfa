"""Megatron-LM's hybrid linear-attention flags (Qwen3-Next's gated delta net): parsing and
parse-time checks.

Names, defaults and meanings are upstream's: ``--experimental-attention-variant`` (``gdn``,
its deprecated alias ``gated_delta_net``; upstream's ``gdn2`` and ``dsa`` are refused here),
``--linear-attention-freq`` (an int N: every N-th layer keeps softmax attention, the others
are gated delta nets; or a Python list expression of 0/1 per layer such as
``"([1]*3+[0]*1)*2"``, 1 = linear), ``--linear-conv-kernel-dim``, ``--linear-key-head-dim``,
``--linear-value-head-dim``, ``--linear-num-key-heads``, ``--linear-num-value-heads``. The
model is ``megatron/core/transformer/gated_delta_net.py``; ``validate_linear_attention_args``
runs the config's own checks, so a bad combination fails before any process group exists.
"""

from __future__ import annotations

import argparse
import ast
import types

from megatron.core.transformer.moe.config import _evaluate
from megatron.core.transformer.transformer_config import TransformerConfig

VARIANTS = ("gdn", "gdn2", "dsa", "gated_delta_net")  # upstream's choices


def parse_linear_attention_freq(text):
    """Upstream's ``la_freq_type``: an int, or a list expression of 0/1 (only list/int
    literals, ``+`` and ``*`` are evaluated, never arbitrary Python)."""
    if text is None or (isinstance(text, int) and not isinstance(text, bool)):
        return text
    text = str(text).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--linear-attention-freq {text!r} is not an int or a list of 0/1; "
                                             "write e.g. 4 or '([1]*3+[0]*1)*2'.") from None
    try:
        value = _evaluate(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(f"--linear-attention-freq {text!r} is not a list of 0/1 ({error}); "
                                         "write e.g. '[1,1,1,0]' or '([1]*3+[0]*1)*2'.") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"--linear-attention-freq {text!r} must give an int or a list of 0/1.")
    return value


def add_linear_attention_args(group) -> None:
    group.add_argument("--experimental-attention-variant", choices=VARIANTS, default=None,
                       help="gdn (alias gated_delta_net): Qwen3-Next's gated delta-net linear attention on the "
                            "layers --linear-attention-freq marks (gdn2 and dsa are not implemented here)")
    group.add_argument("--linear-attention-freq", type=parse_linear_attention_freq, default=None,
                       help="N: every N-th layer softmax attention, the others linear; or a 0/1 list per layer, "
                            "e.g. '([1]*3+[0]*1)*2' (1 = linear)")
    group.add_argument("--linear-conv-kernel-dim", type=int, default=4,
                       help="kernel size of the gated delta net's causal depthwise convolution")
    group.add_argument("--linear-key-head-dim", type=int, default=128, help="gated delta net query/key head dim")
    group.add_argument("--linear-value-head-dim", type=int, default=128, help="gated delta net value/gate head dim")
    group.add_argument("--linear-num-key-heads", type=int, default=16, help="gated delta net query/key heads")
    group.add_argument("--linear-num-value-heads", type=int, default=32,
                       help="gated delta net value heads (a multiple of the key heads)")


def linear_attention_config_kwargs(args) -> dict:
    """The ``TransformerConfig`` fields (getattr: argument sets saved before these flags
    existed mean softmax attention everywhere)."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    return dict(experimental_attention_variant=get("experimental_attention_variant"),
                linear_attention_freq=get("linear_attention_freq"),
                linear_conv_kernel_dim=get("linear_conv_kernel_dim", 4),
                linear_key_head_dim=get("linear_key_head_dim", 128),
                linear_value_head_dim=get("linear_value_head_dim", 128),
                linear_num_key_heads=get("linear_num_key_heads", 16),
                linear_num_value_heads=get("linear_num_value_heads", 32))


def validate_linear_attention_args(args: argparse.Namespace) -> None:
    """The config's gated delta-net checks (ValueError with the fix), at parse time."""
    if getattr(args, "experimental_attention_variant", None) is None and \
            getattr(args, "linear_attention_freq", None) is None:
        return
    # Import cost: the model builder loads the engine; only a gated delta-net config needs it here.
    from megatron.training.model_builder import activation_from_args

    fields = linear_attention_config_kwargs(args)
    fields.update(num_layers=args.num_layers, activation_func=activation_from_args(vars(args)),
                  squared_relu=getattr(args, "squared_relu", False),
                  tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
                  context_parallel_size=getattr(args, "context_parallel_size", 1),
                  multi_latent_attention=getattr(args, "multi_latent_attention", False))
    TransformerConfig._check_linear_attention(types.SimpleNamespace(**fields))
