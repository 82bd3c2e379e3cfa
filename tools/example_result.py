#!/usr/bin/env python
"""Write an example run's result file: what the run measured, when and at which commit.

    python tools/example_result.py --metrics runs/tiny_shakespeare/logs/metrics.jsonl \\
        --output runs/tiny_shakespeare/result.json --nproc 2 --seconds training=265 ...

examples/train_tiny_shakespeare.sh calls it last. The file holds the validation bits per
character at every evaluation (the last is the run's result), the iterations trained, the
wall seconds of each phase, the machine's core count and load average at the start (the
timings are only as good as the machine was idle), the date and the commit. Copied to
benchmarks/results/, it is what scripts/doc_figures.py renders the docs' figures from.
Prints one line with the result.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit() -> str:
    """The working tree's commit (``+`` when it has changes), or "unknown" outside git."""
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--metrics", required=True, help="the run's metrics.jsonl (--log-dir)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--nproc", type=int, required=True, help="ranks the run used")
    parser.add_argument("--load-average", default=None, help="the 1-minute load average when the run started")
    parser.add_argument("--seconds", action="append", default=[], metavar="PHASE=S", help="a phase's wall seconds")
    opts = parser.parse_args(argv)
    with open(opts.metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    validation = [r for r in records if r.get("kind") == "validation" and "bits_per_character" in r]
    if not validation:
        print(f"example_result.py: error: {opts.metrics} has no validation record with bits_per_character; "
              "run with --eval-iters > 0.", file=sys.stderr)
        return 2
    trained = [r["iteration"] for r in records if r.get("kind", "train") == "train" and "iteration" in r]
    seconds = {}
    for item in opts.seconds:
        phase, _, value = item.partition("=")
        seconds[phase] = float(value)
    try:
        load = float(opts.load_average) if opts.load_average is not None else None
    except ValueError:
        load = None
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": commit(),
        "iterations": max(trained) if trained else validation[-1]["iteration"],
        "nproc": opts.nproc,
        "cores": os.cpu_count(),
        "load_average_at_start": load,
        "seconds": seconds,
        "validation_bits_per_character": {str(r["iteration"]): round(r["bits_per_character"], 4) for r in validation},
        "bits_per_character": round(validation[-1]["bits_per_character"], 4),
    }
    with open(opts.output, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"> validation loss {result['bits_per_character']:.3f} bits per character after {result['iterations']} "
          f"iterations; " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()) + f"; result in {opts.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
