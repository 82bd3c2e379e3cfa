"""Upstream Megatron-LM's fill-in-the-middle flags (``--fim-*``): parsing and parse-time
checks. The transform itself is megatron/core/datasets/fim.py; the tokens are looked up in
the tokenizer as soon as it is built (``fim_transform_from_args``), before the model."""

import argparse

from megatron.core.datasets.fim import DEFAULT_FIM_TOKENS, FIMConfig, FIMTransform


def add_fim_args(group) -> None:
    group.add_argument("--fim-data", action="store_true",
                       help="fill-in-the-middle samples (megatron/core/datasets/fim.py)")
    group.add_argument("--fim-rate", type=float, default=0.5,
                       help="probability that a document of a sample is turned into FIM form")
    group.add_argument("--fim-spm-rate", type=float, default=0.5,
                       help="probability that a FIM document uses the SPM order instead of PSM")
    group.add_argument("--fim-split-sample", type=str, default=None,
                       help="a token at which documents are cut into fragments, each FIM'd on its own")
    group.add_argument("--fim-fragment-rate", type=float, default=None,
                       help="probability of FIM for each fragment (with --fim-split-sample)")
    group.add_argument("--fim-no-prefix", type=str, default=None,
                       help="leave pieces whose text starts with this string untouched")
    for name, token in DEFAULT_FIM_TOKENS.items():
        group.add_argument(f"--fim-{name}-token", type=str, default=token, help=f"the FIM {name} token")


def fim_config_from_args(args: argparse.Namespace) -> FIMConfig:
    return FIMConfig(rate=args.fim_rate, spm_rate=args.fim_spm_rate,
                     tokens={name: getattr(args, f"fim_{name}_token") for name in DEFAULT_FIM_TOKENS},
                     split_sample=args.fim_split_sample, fragment_rate=args.fim_fragment_rate,
                     no_prefix=args.fim_no_prefix)


def validate_fim_args(args: argparse.Namespace) -> None:
    if not args.fim_data:
        return
    if args.mock_data:
        raise ValueError("--fim-data rearranges text documents; --mock-data has none. Pass --data-path "
                         "(or neither, for the Shakespeare corpus).")
    if args.tokenizer_type == "NullTokenizer":
        raise ValueError("--fim-data needs a text tokenizer holding the FIM tokens; NullTokenizer has no text.")
    fim_config_from_args(args)  # the rates and --fim-split-sample / --fim-fragment-rate


def fim_transform_from_args(args: argparse.Namespace, tokenizer):
    """The FIM transform (None without --fim-data); fails if the tokenizer lacks a token.
    (getattr: argument sets saved before these flags existed, read back by tools/generate.py.)"""
    return FIMTransform(tokenizer, fim_config_from_args(args)) if getattr(args, "fim_data", False) else None
