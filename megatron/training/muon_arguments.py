"""Upstream Megatron-LM's Muon flags (``--optimizer muon``, ``--muon-*``): parsing and checks.

Names, choices and defaults are upstream's (``megatron/training/arguments.py``). The
deprecated ``--optimizer dist_muon`` is upstream's ``muon`` with its distributed optimizer,
here ``--use-distributed-optimizer`` (ZeRO-1 under MFSDP). Combinations this trainer cannot
run fail at parse time with one line saying what to do.
"""

from __future__ import annotations

import argparse

from megatron.core.optimizer.newton_schulz import COEFFICIENT_TYPES, SCALE_MODES, coefficient_schedule

OPTIMIZERS = ("adam", "sgd", "muon", "dist_muon")
TP_MODES = ("blockwise", "duplicated", "distributed")


def add_muon_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Muon (--optimizer muon)")
    g.add_argument("--muon-momentum", type=float, default=0.9, help="Muon's momentum (an EMA of the gradient)")
    g.add_argument("--muon-no-split-qkv", action="store_false", dest="muon_split_qkv",
                   help="orthogonalize linear_qkv whole (default: its query, key and value matrices apart)")
    g.add_argument("--muon-nesterov", action="store_true", help="Nesterov momentum")
    g.add_argument("--muon-scale-mode", choices=SCALE_MODES, default="spectral",
                   help="the update's scale: spectral sqrt(max(m, n)), unit_rms_norm sqrt(m / n), "
                        "shape_scaling sqrt(max(1, m / n))")
    g.add_argument("--muon-fp32-matmul-prec", choices=("low", "medium", "high"), default="medium",
                   help="medium: the Newton-Schulz steps in bf16; high: in fp32 (TF32 allowed on GPUs)")
    g.add_argument("--muon-coefficient-type", default="quintic",
                   help=f"Newton-Schulz coefficients: {', '.join(COEFFICIENT_TYPES)}")
    g.add_argument("--muon-num-ns-steps", type=int, default=5, help="Newton-Schulz steps")
    g.add_argument("--muon-tp-mode", choices=TP_MODES, default="duplicated",
                   help="TP-split weights: blockwise orthogonalizes each TP piece on its own; duplicated and "
                        "distributed orthogonalize the whole matrix (here both gather it: same values)")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0, help="a further factor on the update")
    g.add_argument("--muon-scalar-optimizer", choices=("adam", "lion"), default="adam",
                   help="the optimizer of what Muon does not take (embeddings, output layer, biases, norms)")


def map_dist_muon(args: argparse.Namespace, note) -> None:
    """``--optimizer dist_muon`` -> ``muon`` with ``--use-distributed-optimizer``, as upstream.
    Runs before ``--use-distributed-optimizer`` is resolved."""
    if args.optimizer == "dist_muon":
        note("--optimizer dist_muon is deprecated (as upstream): it runs as --optimizer muon "
             "--use-distributed-optimizer.")
        args.optimizer = "muon"
        args.use_distributed_optimizer = True


def validate_muon_args(args: argparse.Namespace) -> None:
    """Parse-time checks (ValueError with the fix). Needs the precision and MFSDP fields."""
    if args.optimizer != "muon":
        return
    if args.muon_scalar_optimizer != "adam":
        raise ValueError("--muon-scalar-optimizer lion: Lion is not implemented here; use adam (the default).")
    if args.fp16:
        raise ValueError("--optimizer muon does not support --fp16 (as upstream); use --bf16.")
    if args.muon_fp32_matmul_prec == "low":
        raise ValueError("--muon-fp32-matmul-prec low is not a torch matmul precision (upstream fails at the "
                         "first step); use medium or high.")
    if not 0.0 <= args.muon_momentum < 1.0:
        raise ValueError(f"--muon-momentum must be in [0, 1), got {args.muon_momentum}.")
    if args.muon_coefficient_type not in COEFFICIENT_TYPES:
        raise ValueError(f"--muon-coefficient-type {args.muon_coefficient_type!r} is not known; use one of "
                         f"{', '.join(COEFFICIENT_TYPES)}.")
    try:
        coefficient_schedule(args.muon_coefficient_type, args.muon_num_ns_steps)
    except ValueError as error:
        raise ValueError(f"--muon-num-ns-steps {args.muon_num_ns_steps}: {error}") from None
