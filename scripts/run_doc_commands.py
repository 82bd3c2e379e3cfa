#!/usr/bin/env python
"""Run the commands the documentation tells a user to run, as a new user would.

    python scripts/run_doc_commands.py            # every marked block, in document order
    python scripts/run_doc_commands.py --list     # the blocks and what each asserts, nothing run
    python scripts/run_doc_commands.py --keep     # keep the working directory afterwards

Every ```bash block of README.md, docs/*.md and examples/README.md carries a marker on the
line before it, an HTML comment (GitHub renders nothing for it):

    <!-- doctest: file=ckpt/run1/latest_checkpointed_iteration.txt loss-falls -->
    <!-- doctest: skip="needs a SLURM cluster" -->

An unmarked block is an error, so a new command in the docs cannot go untested unnoticed.
Assertions (``shlex`` words, repeatable):

    exit=N          the block's exit status (default 0; the block runs under bash -e)
    output=REGEX    its stdout+stderr matches
    file=PATH       PATH exists afterwards (relative to the working directory)
    loss-falls      the training log lines it prints ("lm loss: X") fall: last < first
    loss-below=X    the last lm loss it prints (training or validation line) is below X nats
    hf-loads=DIR    transformers' AutoModelForCausalLM loads DIR and its logits are finite
    agree="T% ; A ; B"  the numbers the regexes A and B capture (group 1, first match of each)
                    differ by at most T percent of B (an estimate A against a measurement B)
    timeout=S       seconds before the block counts as hung (default 300)
    skip=REASON     not run (hardware this machine lacks, a fragment): listed with the reason

The blocks run in one fresh working directory, a copy of the repository's files as a clone
would have them (tracked and untracked-but-not-ignored: the working tree as it is), in
document order: README.md, docs/*.md, examples/README.md, like a user who follows them.
Its `.venv` is a fresh virtual environment that sees this interpreter's packages (the test
extras) without installing anything, so `source scripts/setup_env.sh` in a block only
activates it. A block identical to one already run (same commands, comments and the environment's
activation aside, and the same marker) is not run again: it is listed as the same as the first.

Long runs are shortened by one environment variable, MEGATRON_MAX_TRAIN_ITERS (default here
20): pretrain_gpt.py stops every run after at most that many iterations, saying so in one
line; the commands themselves are never edited.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
import venv
from dataclasses import dataclass, field
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_TRAIN_ITERS_ENV = "MEGATRON_MAX_TRAIN_ITERS"  # read by megatron/training/arguments.py
DEFAULT_MAX_TRAIN_ITERS = "20"
DEFAULT_TIMEOUT_S = 300
COMMAND_FENCE = re.compile(r"^```(bash|sh|shell|console)\s*$")
MARKER_START = "<!-- doctest:"
ACTIVATE = "source scripts/setup_env.sh"
ASSERTION_KEYS = {"exit", "output", "file", "loss-falls", "loss-below", "hf-loads", "agree", "timeout", "skip"}
# A training log line's loss ("| lm loss: 6.1E+00 |") and a validation box's ("lm loss value: ...").
TRAIN_LOSS = re.compile(r"\| lm loss: ([0-9.eE+-]+) \|")
ANY_LOSS = re.compile(r"lm loss(?: value)?: ([0-9.eE+-]+) \|")


def documents(repo: str = REPO) -> List[str]:
    """The documents a user follows, in the order the runner walks them (repo-relative)."""
    docs = sorted(os.path.relpath(p, repo) for p in glob.glob(os.path.join(repo, "docs", "*.md")))
    return ["README.md"] + docs + ["examples/README.md"]


@dataclass
class Block:
    path: str                     # repo-relative document
    line: int                     # 1-based line of the opening fence
    command: str                  # the block's text, as a user would paste it
    marker: Dict[str, List[str]] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def skip(self) -> Optional[str]:
        return self.marker["skip"][0] if "skip" in self.marker else None

    def first(self, key: str, default=None):
        return self.marker[key][0] if key in self.marker else default

    def commands_only(self) -> str:
        """The command without its comments (a comment after the command, or a comment line)
        and without `source scripts/setup_env.sh` (in the runner's shell it only activates
        the environment every block already runs in)."""
        lines = (re.sub(r"\s+#[^'\"]*$", "", s).rstrip() for s in self.command.splitlines())
        return "\n".join(s for s in lines if s and not s.lstrip().startswith("#") and s != ACTIVATE)

    def summary(self) -> str:
        lines = [s for s in self.command.strip().splitlines() if not s.startswith(("#", "source "))]
        first = lines[0] if lines else ""
        return first if len(first) <= 90 else first[:87] + "..."


def parse_marker(text: str, where: str) -> Dict[str, List[str]]:
    """``key=value`` words (or a bare ``key``) of a marker comment."""
    marker: Dict[str, List[str]] = {}
    for word in shlex.split(text):
        key, _, value = word.partition("=")
        if key not in ASSERTION_KEYS:
            raise ValueError(f"{where}: unknown doctest key {key!r}; known: {', '.join(sorted(ASSERTION_KEYS))}.")
        marker.setdefault(key, []).append(value)
    if "skip" in marker and not marker["skip"][0]:
        raise ValueError(f'{where}: skip needs a reason: skip="needs ...".')
    return marker


def extract_blocks(path: str, repo: str = REPO) -> List[Block]:
    """The command blocks of one document with their markers; an unmarked one raises."""
    with open(os.path.join(repo, path), encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if not COMMAND_FENCE.match(lines[i]):
            if lines[i].startswith("```"):  # another fenced block: skip to its end
                i += 1
                while i < len(lines) and not lines[i].startswith("```"):
                    i += 1
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        where = f"{path}:{start + 1}"
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        comment = []
        if j >= 0 and lines[j].rstrip().endswith("-->"):
            while j >= 0:
                comment.insert(0, lines[j])
                if MARKER_START in lines[j] or "<!--" in lines[j]:
                    break
                j -= 1
        text = " ".join(s.strip() for s in comment)
        if not text.startswith(MARKER_START):
            raise ValueError(
                f"{where}: a command block without a doctest marker; put `<!-- doctest: ... -->` (what it "
                f'asserts) or `<!-- doctest: skip="why" -->` on the line before it (scripts/run_doc_commands.py).')
        marker = parse_marker(text[len(MARKER_START):-len("-->")], where)
        blocks.append(Block(path, start + 1, "\n".join(body) + "\n", marker))
        i += 1
    return blocks


def all_blocks(repo: str = REPO) -> List[Block]:
    return [b for doc in documents(repo) for b in extract_blocks(doc, repo)]


# The fresh working directory ------------------------------------------------------------
def copy_tree(repo: str, dest: str) -> None:
    """The files a clone of the working tree has: tracked plus untracked-but-not-ignored
    (mtimes kept, so setup.py is not newer than the environment's install stamps)."""
    files = subprocess.run(["git", "-C", repo, "ls-files", "-z", "-co", "--exclude-standard"],
                           check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = os.path.join(repo, rel)
        if not os.path.isfile(src):  # deleted but still in the index
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel))


def make_venv(work: str) -> str:
    """``work/.venv``: a new environment that sees this interpreter's packages through a .pth
    file (no install, no network), stamped as scripts/setup_env.sh stamps an installed one."""
    path = os.path.join(work, ".venv")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(path)
    purelib = subprocess.run([os.path.join(path, "bin", "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    shared = [p for p in site.getsitepackages() if os.path.isdir(p)]
    with open(os.path.join(purelib, "_doctest_shared_packages.pth"), "w") as f:
        f.write("\n".join(shared) + "\n")
    # setup_env.sh installs when its stamp is missing; the packages are the caller's, which
    # has the test extras (scripts/run_tests.sh sources MEGATRON_EXTRAS=test before this).
    for stamp in (".megatron-installed", ".megatron-installed-test"):
        open(os.path.join(path, stamp), "w").close()
    return path


def block_environment(work: str, venv_path: str) -> Dict[str, str]:
    """The shell of a user who sourced scripts/setup_env.sh in ``work``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "MEGATRON_VENV", "MEGATRON_EXTRAS", "MEGATRON_TORCH")}
    caller_bin = os.path.dirname(sys.executable)
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and os.path.abspath(p) != caller_bin]
    env.update(
        PATH=os.pathsep.join([os.path.join(venv_path, "bin")] + path),
        VIRTUAL_ENV=venv_path,
        PYTHONPATH=work,
        PYTHONUNBUFFERED="1",
    )
    env.setdefault(MAX_TRAIN_ITERS_ENV, DEFAULT_MAX_TRAIN_ITERS)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("WANDB_MODE", "offline")
    return env


# Running and checking one block ---------------------------------------------------------
def run_block(block: Block, work: str, env: Dict[str, str], log_path: str) -> List[str]:
    """Run ``block`` in ``work``; the list of broken promises (empty: it passed)."""
    timeout = float(block.first("timeout", DEFAULT_TIMEOUT_S))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", block.command], cwd=work, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the block's own process group: its ranks too
            proc.wait()
            return [f"still running after {timeout:.0f} s (timeout=); killed"]
        except BaseException:  # the runner stopped (Ctrl-C, the stage's outer timeout): no orphans
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    with open(log_path, errors="replace") as f:
        output = f.read()
    failures = []
    expected = int(block.first("exit", 0))
    if code != expected:
        failures.append(f"exit status {code}, expected {expected}")
    for pattern in block.marker.get("output", []):
        if not re.search(pattern, output):
            failures.append(f"output has no match for {pattern!r}")
    for rel in block.marker.get("file", []):
        if not os.path.exists(os.path.join(work, rel)):
            failures.append(f"{rel} does not exist")
    if "loss-falls" in block.marker:
        losses = [float(x) for x in TRAIN_LOSS.findall(output)]
        if len(losses) < 2 or not losses[-1] < losses[0]:
            failures.append(f"the training loss does not fall: {losses} (need two log lines or more)")
    for bound in block.marker.get("loss-below", []):
        losses = [float(x) for x in ANY_LOSS.findall(output)]
        if not losses or not losses[-1] < float(bound):
            failures.append(f"the last lm loss printed ({losses[-1] if losses else 'none'}) is not below {bound}")
    for spec in block.marker.get("agree", []):
        failures += check_agree(spec, output)
    for rel in block.marker.get("hf-loads", []):
        failures += check_hf_loads(os.path.join(work, rel), work, env)
    return failures


def check_agree(spec: str, output: str) -> List[str]:
    """``agree="T% ; A ; B"``: the numbers A and B capture are within T percent of B."""
    try:
        tolerance, *patterns = [part.strip() for part in spec.split(" ; ")]
        percent = float(tolerance.rstrip("%"))
    except ValueError:
        return [f'agree={spec!r} is not "T% ; REGEX ; REGEX"']
    if len(patterns) != 2 or not tolerance.endswith("%"):
        return [f'agree={spec!r} is not "T% ; REGEX ; REGEX"']
    values = []
    for pattern in patterns:
        match = re.search(pattern, output)
        if not match:
            return [f"output has no match for {pattern!r} (agree=)"]
        values.append(float(match.group(1)))
    estimate, measured = values
    if abs(estimate - measured) > percent / 100 * abs(measured):
        return [f"{estimate} ({patterns[0]!r}) is not within {tolerance} of {measured} ({patterns[1]!r})"]
    return []


HF_LOAD = """import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = torch.arange(8).remainder(model.config.vocab_size).unsqueeze(0)
logits = model(ids).logits
assert torch.isfinite(logits).all(), "non-finite logits"
print(type(model).__name__, tuple(logits.shape))
"""


def check_hf_loads(path: str, work: str, env: Dict[str, str]) -> List[str]:
    proc = subprocess.run([os.path.join(env["VIRTUAL_ENV"], "bin", "python"), "-c", HF_LOAD, path], cwd=work,
                          env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        return [f"transformers does not load {os.path.relpath(path, work)}: " + (proc.stderr.strip().splitlines() or ["?"])[-1]]
    return []


def leftover_files(repo: str, work: str, before: set) -> List[str]:
    """Files the commands wrote that `git status` would show (not ignored by .gitignore)."""
    new = []
    for root, dirs, files in os.walk(work):
        dirs[:] = [d for d in dirs if d not in (".venv", "__pycache__")]
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), work)
            if rel not in before:
                new.append(rel)
    if not new:
        return []
    ignored = subprocess.run(["git", "-C", repo, "check-ignore", "--no-index", "--stdin"], input="\n".join(new),
                             capture_output=True, text=True).stdout.split()
    return sorted(set(new) - set(ignored))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the blocks and their markers; run nothing")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (its path is printed)")
    parser.add_argument("--only", default=None, help="run only the blocks of this document (e.g. docs/checkpointing.md)")
    opts = parser.parse_args(argv)
    try:
        blocks = all_blocks()
    except ValueError as error:
        print(f"run_doc_commands.py: error: {error}", file=sys.stderr)
        return 2
    if opts.list:
        for b in blocks:
            what = f"not run: {b.skip}" if b.skip else " ".join(
                f"{k}={v}" if v else k for k, vs in b.marker.items() for v in vs)
            print(f"{b.where:28} {b.summary()}\n{'':28}   {what}")
        return 0

    # The stage's outer `timeout` sends SIGTERM: unwind (kill the running block, remove the copy).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    work = tempfile.mkdtemp(prefix="doc-commands-")
    try:
        return _run(blocks, work, opts)
    finally:
        if opts.keep:
            print(f"> kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _run(blocks: List[Block], work: str, opts) -> int:
    start = time.time()
    copy_tree(REPO, work)
    env = block_environment(work, make_venv(work))
    before = {os.path.relpath(os.path.join(r, n), work) for r, _, fs in os.walk(work) for n in fs}
    print(f"> working directory {work} (a copy of the working tree; {MAX_TRAIN_ITERS_ENV}="
          f"{env[MAX_TRAIN_ITERS_ENV]}), ready in {time.time() - start:.1f} s", flush=True)
    results, seen, failed = [], {}, False
    for b in blocks:
        if opts.only and b.path != opts.only:
            continue
        key = (b.commands_only(), tuple(sorted((k, tuple(v)) for k, v in b.marker.items())))
        if b.skip:
            results.append((b, "not run", b.skip, None))
            continue
        if key in seen:
            results.append((b, "same as", seen[key], None))
            continue
        seen[key] = b.where
        print(f"=== {b.where}: {b.summary()}", flush=True)
        log_path = os.path.join(work, ".doc-commands-logs", b.where.replace("/", "_").replace(":", "_") + ".log")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        t0 = time.time()
        failures = run_block(b, work, env, log_path)
        elapsed = time.time() - t0
        if failures:
            failed = True
            with open(log_path, errors="replace") as f:
                tail = f.read().splitlines()[-40:]
            print("\n".join("    | " + line for line in tail))
            print("\n".join(f"    FAILED: {f}" for f in failures), flush=True)
        results.append((b, "FAILED" if failures else "passed", "; ".join(failures), elapsed))
        print(f"    {'FAILED' if failures else 'passed'} in {elapsed:.1f} s", flush=True)
    before.update(os.path.relpath(os.path.join(r, n), work)
                  for r, _, fs in os.walk(os.path.join(work, ".doc-commands-logs")) for n in fs)
    leftovers = leftover_files(REPO, work, before)

    print("=== documented commands: result and wall time")
    for b, result, detail, elapsed in results:
        time_s = f"{elapsed:6.1f} s" if elapsed is not None else "       -"
        extra = f" ({detail})" if detail and result != "passed" else ""
        print(f"{b.where:28} {result:8} {time_s}  {b.summary()}{extra}")
    if leftovers:
        print(f"note: the commands left {len(leftovers)} file(s) that `git status` would show (add them to "
              f".gitignore): {', '.join(leftovers[:10])}{' ...' if len(leftovers) > 10 else ''}")
    print(f"> {sum(r[1] == 'passed' for r in results)} passed, {sum(r[1] == 'FAILED' for r in results)} failed, "
          f"{sum(r[1] == 'not run' for r in results)} not run, {sum(r[1] == 'same as' for r in results)} repeated; "
          f"{time.time() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
