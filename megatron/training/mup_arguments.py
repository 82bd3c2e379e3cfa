"""Upstream Megatron-LM's muP flags (``--use-mup``, ``--mup-*``; TransformerConfig fields
there): parsing, parse-time checks and the config fields.

With ``--use-mup`` and width multiplier m = hidden_size / --mup-base-hidden-size (default
hidden_size, m = 1), as upstream:

* init: hidden weights normal(0, init_method_std / sqrt(m)), the residual-writing ones also
  / sqrt(2 * num_layers); the embedding and the output layer keep init_method_std;
* attention: softmax scale sqrt(--mup-base-head-dim or 1) / d_head ** --mup-attn-scale-power
  (default power 1: 1 / d_head);
* embedding output times --mup-embedding-mult; logits times --mup-output-mult (left at 1:
  1 / m);
* optimizer (megatron/core/optimizer/param_groups.py ``mup_overrides``): Adam: hidden
  matrices' LR, min LR and eps / m; SGD: vector-like parameters' LR and min LR * m; Muon:
  the matrices Muon does not update get LR / m.
"""

import argparse

MUP_DEFAULTS = dict(mup_base_hidden_size=None, mup_embedding_mult=1.0, mup_output_mult=1.0,
                    mup_base_head_dim=None, mup_attn_scale_power=1.0, mup_width_mult=1.0)


def add_mup_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("muP (Maximal Update Parameterization)")
    g.add_argument("--use-mup", action="store_true",
                   help="muP: init, attention scale, multipliers and LR scaled by the width multiplier")
    g.add_argument("--mup-base-hidden-size", type=int, default=None,
                   help="the base (proxy) model's hidden size; width multiplier = hidden-size / this "
                        "(default: hidden-size)")
    g.add_argument("--mup-embedding-mult", type=float, default=1.0, help="multiplier of the embedding output")
    g.add_argument("--mup-output-mult", type=float, default=1.0,
                   help="multiplier of the logits (left at 1.0: 1 / width multiplier)")
    g.add_argument("--mup-base-head-dim", type=float, default=None,
                   help="softmax scale = sqrt(this) / head_dim ** --mup-attn-scale-power (default sqrt(1))")
    g.add_argument("--mup-attn-scale-power", type=float, default=1.0,
                   help="1.0: muP's 1 / head_dim attention scale; 0.5: the standard 1 / sqrt(head_dim)")
    g.add_argument("--mup-width-mult", type=float, default=1.0,
                   help="upstream's derived field: with --use-mup it is hidden-size / --mup-base-hidden-size "
                        "whatever is given")


def validate_mup_args(args: argparse.Namespace, note) -> None:
    """Parse-time checks (ValueError with the fix); ``note`` prints one line from rank 0."""
    given = [f"--{k.replace('_', '-')}" for k, v in MUP_DEFAULTS.items() if getattr(args, k) != v]
    if not args.use_mup:
        if given:
            note(f"{', '.join(given)} without --use-mup: no effect (as upstream); add --use-mup for muP.")
        return
    if args.mup_base_hidden_size is not None and args.mup_base_hidden_size < 1:
        raise ValueError(f"--mup-base-hidden-size must be positive, got {args.mup_base_hidden_size}.")
    if args.mup_base_head_dim is not None and args.mup_base_head_dim <= 0:
        raise ValueError(f"--mup-base-head-dim must be positive, got {args.mup_base_head_dim}.")
    if getattr(args, "multi_latent_attention", False):
        raise ValueError("--use-mup is not supported with --multi-latent-attention here (its softmax scale is "
                         "its own); drop one of them.")
    if "--mup-width-mult" in given:
        note("--mup-width-mult is derived under --use-mup (hidden-size / --mup-base-hidden-size); the value given "
             "is not used, as upstream.")
    args.mup_width_mult = args.hidden_size / (args.mup_base_hidden_size or args.hidden_size)


def mup_config_kwargs(args) -> dict:
    """The TransformerConfig fields (getattr: argument sets saved before these flags existed)."""
    if not getattr(args, "use_mup", False):
        return {}
    return dict(use_mup=True, **{k: getattr(args, k) for k in MUP_DEFAULTS if k != "mup_width_mult"})
