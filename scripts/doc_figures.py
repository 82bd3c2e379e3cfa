#!/usr/bin/env python
"""The figures the documentation quotes, generated from the result files that measured them.

    python scripts/doc_figures.py            # check: exit 1 naming each figure the docs state differently
    python scripts/doc_figures.py --write    # rewrite every figure in the docs from its result file

A figure sits in the Markdown between two HTML comments, which GitHub does not render:

    ... run unchanged (<!-- figure: replay-gpt -->151 of upstream's 161 GPT training
    lines<!-- /figure --> parse at ...

and its text is whatever FIGURES[name] renders from its source: a result file under
benchmarks/results/ (with the date and the engine commit the file records; the quickstart's
is the result.json examples/train_tiny_shakespeare.sh writes, tools/example_result.py,
copied there), or a count the
project computes from a snapshot it carries (the upstream replay, computed live: the code at
hand is its commit). tests/unit_tests/test_doc_figures.py and
tests/upstream_lines/test_upstream_replay.py fail when the docs and the sources disagree;
`--write` is the one command that brings the docs back in step.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Callable, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
FIGURE = re.compile(r"<!-- figure: ([a-z0-9-]+) -->(.*?)<!-- /figure -->", re.S)

# Result files that record no date or commit of their own: when and where they were committed.
RECORDED = {
    "largest_model.json": ("2026-12-01", "619846f"),
}


def documents(repo: str = REPO) -> List[str]:
    paths = [os.path.join(repo, "README.md"), os.path.join(repo, "examples", "README.md")] + sorted(
        glob.glob(os.path.join(repo, "docs", "*.md")))
    return [p for p in paths if os.path.exists(p)]


def _load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


# The figures ------------------------------------------------------------------------------
def replay_counts(suite: str = "gpt") -> Tuple[str, Dict[str, int]]:
    """scripts/replay_upstream_configs.py over its snapshot: (upstream commit, counts)."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import replay_upstream_configs as replay  # scripts/ is not a package; a few seconds of parsing

    commit, configs = replay.load_snapshot(replay.SUITES[suite][1])
    counts, _ = replay.replay(configs)
    return commit, dict(counts)


_REPLAY_CACHE: Dict[str, Tuple[str, Dict[str, int]]] = {}


def _replay(suite: str) -> Tuple[str, Dict[str, int]]:
    if suite not in _REPLAY_CACHE:
        _REPLAY_CACHE[suite] = replay_counts(suite)
    return _REPLAY_CACHE[suite]


def replay_gpt() -> str:
    commit, counts = _replay("gpt")
    return (f"{counts['accepted']} of upstream's {counts['training lines']} GPT training lines "
            f"(upstream {commit[:7]})")


def replay_gpt_flags_doc() -> str:
    commit, counts = _replay("gpt")
    return (f"Of the {counts['training lines']} training configurations ({counts['skipped (MODE inference/rl)']} "
            f"inference/RL ones\nare skipped), {counts['accepted']} parse at their own TP/PP/CP sizes")


def replay_moe_flags_doc() -> str:
    commit, counts = _replay("moe")
    return f"{counts['accepted']} of the {counts['training lines']} training configurations parse"


def _compare(world_size: int) -> Tuple[dict, str]:
    data = _load(f"compare_n{world_size}.json")
    when = data["driver"]["finished"].split()[0]
    return data["runs"]["fp32"]["results"], f"{when}, engine {data['environment']['engine']['commit']}"


def _fraction(ratio: float) -> str:
    """1/N when the ratio is within 2% of one, else two decimals."""
    n = round(1 / ratio)
    return f"1/{n}" if n >= 1 and abs(ratio * n - 1) < 0.02 else f"{ratio:.2f}"


def compare_50m() -> str:
    r2, when2 = _compare(2)
    r4, when4 = _compare(4)

    def step(r, name):
        return r[name]["timing"]["step"]["median"]

    def ratio(r, other):
        return f"{step(r, 'mfsdp_zero3') / step(r, other):.2f}"

    def bytes_(r):
        return _fraction(r["mfsdp_zero3"]["persistent_bytes"]["total"] / r["ddp"]["persistent_bytes"]["total"])

    params = r2["mfsdp_zero3"].get("num_params") or _load("compare_n2.json")["runs"]["fp32"]["num_params"]
    when = when2 if when2 == when4 else f"{when2}; {when4}"
    return (f"On a {params / 1e6:.0f}M GPT in fp32 (CPU, gloo, one interleaved run) a ZeRO-3 step takes "
            f"{ratio(r2, 'fsdp2')} (2 ranks)\nand {ratio(r4, 'fsdp2')} (4 ranks) of FSDP2's time and "
            f"{ratio(r2, 'ddp')} and {ratio(r4, 'ddp')} of DDP's, holding {bytes_(r2)} and {bytes_(r4)} of\n"
            f"DDP's persistent bytes per rank (`benchmarks/results/compare_n2.json`, `compare_n4.json`: {when}).")


def largest_model() -> str:
    data = _load("largest_model.json")
    best = {r["contender"]: r["best"]["params"] for r in data["results"]}
    opts = data["options"]
    date, commit = RECORDED["largest_model.json"]
    return (f"{opts['nproc']} CPU ranks train a {best['mfsdp_zero3'] / 1e9:.2f}B-parameter GPT\nthis way (ZeRO-3, "
            f"`--recompute-granularity full`), against {best['fsdp2'] / 1e9:.2f}B for FSDP2 and "
            f"{best['ddp'] / 1e9:.2f}B for\nDDP (`benchmarks/results/largest_model.json`: {date}, commit {commit}")


def _quickstart() -> dict:
    """The result file examples/train_tiny_shakespeare.sh wrote (tools/example_result.py)."""
    return _load("tiny_shakespeare.json")


def _load_note(data: dict) -> str:
    load, cores = data.get("load_average_at_start"), data.get("cores")
    if load is None:
        return f"{cores} cores"
    return f"{cores} cores at load average {load:.1f}" if load >= 0.5 else f"{cores} idle cores"


def quickstart() -> str:
    data = _quickstart()
    minutes = data["seconds"]["training"] / 60
    return (f"{data['iterations']} iterations: {minutes:.1f} minutes on {_load_note(data)}, to "
            f"{data['bits_per_character']:.2f} bits per character on the validation split "
            f"(`benchmarks/results/tiny_shakespeare.json`: {data['date']}, commit {data['commit']})")


def quickstart_curve() -> str:
    data = _quickstart()
    curve = data["validation_bits_per_character"]
    iterations = sorted(curve, key=int)
    last = iterations[-1]
    seconds = data["seconds"]
    head = "| iteration | " + " | ".join(f"**{i}**" if i == last else i for i in iterations) + " |"
    rule = "|---|" + "---|" * len(iterations)
    row = "| validation bits per character | " + " | ".join(
        f"**{curve[i]:.3f}**" if i == last else f"{curve[i]:.3f}" for i in iterations) + " |"
    return (f"Measured with {data['nproc']} ranks on {_load_note(data)} "
            f"(`benchmarks/results/tiny_shakespeare.json`: {data['date']}, commit {data['commit']}; "
            f"the run is deterministic, so a rerun prints the same bits per character, not the same times):\n\n"
            f"{head}\n{rule}\n{row}\n\n"
            f"Training took {seconds['training']:.0f} s of the example's {seconds['whole']:.0f} s "
            f"({seconds['training'] / data['iterations']:.2f} s per iteration, evaluations included), "
            f"{seconds['prepare']:.0f} s went to the corpus and the tokenizer.")


FIGURES: Dict[str, Callable[[], str]] = {
    "replay-gpt": replay_gpt,
    "replay-gpt-flags-doc": replay_gpt_flags_doc,
    "replay-moe-flags-doc": replay_moe_flags_doc,
    "compare-50m": compare_50m,
    "largest-model": largest_model,
    "quickstart": quickstart,
    "quickstart-curve": quickstart_curve,
}
# Figures computed by running code rather than reading a file: their test runs where that code
# already runs (tests/upstream_lines/test_upstream_replay.py).
LIVE = {"replay-gpt", "replay-gpt-flags-doc", "replay-moe-flags-doc"}


# Reading and writing the docs ---------------------------------------------------------------
def figures_in(text: str) -> List[Tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FIGURE.finditer(text)]


def render(text: str, names: Optional[set] = None) -> str:
    """``text`` with every figure (of ``names``, default all) regenerated."""
    def one(m):
        name = m.group(1)
        if name not in FIGURES:
            raise KeyError(f"unknown figure {name!r}; known: {', '.join(sorted(FIGURES))}")
        if names is not None and name not in names:
            return m.group(0)
        return f"<!-- figure: {name} -->{FIGURES[name]()}<!-- /figure -->"
    return FIGURE.sub(one, text)


def keep_figures(new_text: str, old_text: str) -> str:
    """``new_text`` with each figure's text taken from ``old_text`` (for generated pages, e.g.
    docs/megatron_flags.md, whose generator owns the prose but not the figures)."""
    old = dict(figures_in(old_text))
    return FIGURE.sub(lambda m: f"<!-- figure: {m.group(1)} -->{old.get(m.group(1), m.group(2))}<!-- /figure -->",
                      new_text)


def stale(names: Optional[set] = None, repo: str = REPO) -> List[str]:
    """One line per figure whose text in the docs differs from its source."""
    out = []
    for path in documents(repo):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for name, shown in figures_in(text):
            if names is not None and name not in names:
                continue
            expected = FIGURES[name]()
            if shown != expected:
                out.append(f"{os.path.relpath(path, repo)}: figure {name}: the docs say {shown!r}, "
                           f"its source says {expected!r}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the figures in the docs")
    opts = parser.parse_args(argv)
    if opts.write:
        for path in documents():
            with open(path, encoding="utf-8") as f:
                text = f.read()
            new = render(text)
            if new != text:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
                print(f"updated {os.path.relpath(path, REPO)}")
        return 0
    problems = stale()
    print("\n".join(problems) if problems else "every figure in the docs matches its source")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
