"""The reliability flags: the re-run state machine (``megatron/core/rerun_state_machine.py``)
and the weight hash check across data-parallel replicas (``megatron/core/distributed/weight_hash.py``).
Names, choices, defaults and meanings are Megatron-LM's: ``--rerun-mode`` defaults to
``validate_results`` (a step costs one all-reduce of an int and a copy of the RNG states;
``disabled`` skips a NaN/Inf step instead of stopping)."""

from __future__ import annotations

import argparse
import os

RERUN_MODES = ("disabled", "validate_results", "report_stats")
ERROR_INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")


def add_resilience_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("reliability (re-run state machine, weight hashes)")
    g.add_argument("--rerun-mode", choices=RERUN_MODES, default="validate_results",
                   help="validate_results: re-run a step whose loss fails validation (NaN, Inf, spike) to tell "
                        "a transient fault (job stops, exit 17) from a reproducible result (checkpoint, exit 16); "
                        "report_stats: run every step twice and report how much the results differ; disabled: "
                        "skip a step with a NaN/Inf gradient. The machine's state is saved in checkpoints: resumed "
                        "after exit 16, the step is re-run once more to establish a diagnostic")
    g.add_argument("--result-rejected-tracker-filename", type=str, default=None,
                   help="append a line (time, node, device, job, rank, iteration, status, result, message) to "
                        "this file for every rejected result and every re-run's verdict")
    g.add_argument("--error-injection-rate", type=int, default=0,
                   help="with --rerun-mode validate_results: declare about one validation in N wrong (1: every "
                        "one after the first step), to test the re-run machinery; 0: never")
    g.add_argument("--error-injection-type", choices=ERROR_INJECTION_TYPES, default="transient_error",
                   help="what an injected error pretends to be on re-run: not reproducible (transient_error), "
                        "reproducible (persistent_error), or a right result (correct_result)")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="with --rerun-mode: also validate each micro-batch's loss against 10x the largest of "
                        "its first 100 values (not fatal)")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                   help="every N iterations (and at the start) compare hashes of the weights that data-parallel "
                        "ranks hold in common; a mismatch stops the run naming the diverging rank(s)")


def validate_resilience_args(args: argparse.Namespace) -> None:
    interval = args.check_weight_hash_across_dp_replicas_interval
    if getattr(args, "test_mode", False) and interval is None:
        # Upstream's --test-mode compares replicated weights across ranks as training runs.
        args.check_weight_hash_across_dp_replicas_interval = interval = 1
    if interval is not None and interval < 1:
        raise ValueError(f"--check-weight-hash-across-dp-replicas-interval must be >= 1 (got {interval}); "
                         "leave it out to skip the check.")
    tracker = args.result_rejected_tracker_filename
    if tracker is not None:
        folder = os.path.dirname(os.path.abspath(tracker))
        if os.path.isdir(tracker) or not os.access(tracker if os.path.exists(tracker) else folder, os.W_OK):
            raise ValueError(f"--result-rejected-tracker-filename {tracker}: cannot append to it; name a writable "
                             "file (its directory must exist).")
    if args.error_injection_rate < 0:
        raise ValueError(f"--error-injection-rate must be >= 0 (got {args.error_injection_rate}); 0 injects none.")
    if args.error_injection_rate and args.rerun_mode != "validate_results":
        raise ValueError("--error-injection-rate tests the re-run machinery; add --rerun-mode validate_results.")
    if args.check_for_spiky_loss and args.rerun_mode == "disabled":
        raise ValueError("--check-for-spiky-loss validates through the re-run state machine; add "
                         "--rerun-mode validate_results (or report_stats).")
