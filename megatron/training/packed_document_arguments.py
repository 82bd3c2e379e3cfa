"""Upstream Megatron-LM's packed-document flags: parsing and parse-time checks.

A training sample is a window of the concatenated documents, each ended by an EOD token.
``--reset-position-ids`` restarts the position ids after every EOD, ``--reset-attention-mask``
keeps attention inside each document and ``--eod-mask-loss`` (parsed with the data flags)
drops the loss where the input token is EOD; ``packed_document_fields`` in
megatron/core/datasets/gpt_dataset.py computes them per sample, ``DocumentMask`` in
megatron/core/transformer/document_mask.py applies the attention part (under TP/SP, CP of
every ``--cp-comm-type`` and PP alike).
"""

import argparse


def add_packed_document_args(group) -> None:
    group.add_argument("--reset-position-ids", action="store_true",
                       help="position ids restart at 0 after each EOD token (packed documents)")
    group.add_argument("--reset-attention-mask", action="store_true",
                       help="attention stays inside each document: a token attends to its own document's tokens "
                            "up to itself (a block-diagonal causal mask built from the EOD tokens)")


def validate_packed_document_args(args: argparse.Namespace) -> None:
    if args.reset_attention_mask and getattr(args, "experimental_attention_variant", None) in ("gdn",
                                                                                                "gated_delta_net"):
        raise ValueError("--reset-attention-mask is not supported with --experimental-attention-variant gdn (the "
                         "gated delta net's recurrence carries its state across documents); drop one of them.")
