"""How many of upstream Megatron-LM's GPT functional-test command lines this trainer accepts.

Reads every ``tests/functional_tests/test_cases/gpt/*/model_config.yaml`` of the upstream
mirror (a bare git repository, read with ``git show``), or, without the mirror, the
snapshot of their MODEL_ARGS in tests/functional_tests/upstream_gpt_configs.json
(``--write-snapshot`` refreshes it from the mirror). Inference and RL configurations
(MODE inference/rl) are skipped: they do not run pretrain_gpt.py.

Each line gets the CPU substitutions (gloo for nccl, the local layers for Transformer
Engine, FP8 / NCCL user-buffer / TP-comm-overlap flags dropped), mock data (a tiny real
dataset for --fim-data) and the GPT-2 tokenizer instead of files that are not here, and a
tiny model, but keeps its TP/PP/CP sizes; parse_args then runs at the world size upstream launches (8 ranks, or more when
the model-parallel sizes need it). A line rejected only because of PP/CP > 1 (it parses
with those sizes at 1 and the pipeline-only flags dropped) counts as "blocked by PP/CP".

    python scripts/replay_upstream_configs.py [--verbose] [--snapshot | --write-snapshot]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, REPO)
MIRROR = "/work/.mirror/NVIDIA+Megatron-LM/repo"
CASES = "tests/functional_tests/test_cases/gpt"
SNAPSHOT = os.path.join(REPO, "tests", "functional_tests", "upstream_gpt_configs.json")
# Upstream's MoE recipes (DeepSeek-V3, Qwen-MoE, Mixtral) live in their own folder: --suite moe.
SUITES = {
    "gpt": (CASES, SNAPSHOT),
    "moe": ("tests/functional_tests/test_cases/moe",
            os.path.join(REPO, "tests", "functional_tests", "upstream_moe_configs.json")),
}
SKIPPED_MODES = ("inference", "rl")

# The tiny model; the parallel sizes stay upstream's.
SCALE = {
    "--num-layers": 4, "--hidden-size": 128, "--num-attention-heads": 8, "--seq-length": 64,
    "--max-position-embeddings": 64, "--micro-batch-size": 1, "--ffn-hidden-size": 256,
    "--kv-channels": 16, "--train-iters": 3, "--eval-iters": 1,
}
SUBSTITUTE = {"nccl": "gloo", "transformer_engine": "local"}
PIPELINE_OR_CONTEXT = ("--pipeline-model-parallel-size", "--context-parallel-size")
VARIABLES = {"REPEAT": "1", "WANDB_EXPERIMENT": "replay"}  # the others are paths: a temporary directory
DATA_FLAGS = ("--data-path", "--vocab-file", "--merge-file", "--tokenizer-model", "--tokenizer-type",
              "--data-args-path", "--per-split-data-args-path")


def _dropped(flag: str) -> bool:
    """Flags for hardware this machine lacks (FP8, NCCL user buffers, TP-comm overlap)."""
    return (flag.startswith("--fp8") or flag.startswith("--tp-comm-overlap") or "nccl-ub" in flag
            or flag in ("--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16"))


def _pipeline_only(flag: str) -> bool:
    from megatron.training.megatron_compat import REJECTED

    reason = REJECTED.get(flag, "")
    # The pipeline flags (all named "...pipeline...", or the p2p overlap) mean nothing at PP 1.
    return "pipeline" in flag or "p2p" in flag or "pipeline" in reason or "context parallelism" in reason


def _takes_list(flag: str) -> bool:
    from megatron.training.arguments import build_parser

    if not hasattr(_takes_list, "actions"):
        _takes_list.actions = build_parser()._option_string_actions
    action = _takes_list.actions.get(flag)
    return action is not None and (action.nargs in ("*", "+") or (isinstance(action.nargs, int) and action.nargs > 1))


def load_from_mirror(cases=CASES):
    """{name: (mode, [[flag, value], ...])} from the mirror's yaml files."""
    import yaml

    names = subprocess.run(["git", "-C", MIRROR, "ls-tree", "--name-only", "HEAD", cases + "/"],
                           check=True, capture_output=True, text=True).stdout.split()
    commit = subprocess.run(["git", "-C", MIRROR, "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    configs = {}
    for path in names:
        show = subprocess.run(["git", "-C", MIRROR, "show", f"HEAD:{path}/model_config.yaml"],
                              capture_output=True, text=True)
        if show.returncode:
            continue
        doc = yaml.safe_load(show.stdout) or {}
        args = doc.get("MODEL_ARGS")
        if not isinstance(args, dict):
            continue
        configs[os.path.basename(path)] = (doc.get("MODE", "pretraining"), [[k, v] for k, v in args.items()])
    return commit, configs


def load_snapshot(snapshot=SNAPSHOT):
    data = json.load(open(snapshot))
    modes = data.get("modes", {})
    return data["commit"], {name: (modes.get(name, "pretraining"), args) for name, args in data["configs"].items()}


def write_snapshot(commit, configs, snapshot=SNAPSHOT, cases=CASES):
    """Keeps the snapshot's layout (name -> MODEL_ARGS pairs) that the tests read."""
    data = {
        "source": f"NVIDIA/Megatron-LM {cases}/<name>/model_config.yaml, MODEL_ARGS "
                  "(scripts/replay_upstream_configs.py --write-snapshot)",
        "commit": commit,
        "modes": {name: mode for name, (mode, _) in sorted(configs.items()) if mode != "pretraining"},
        "configs": {name: args for name, (_, args) in sorted(configs.items())},
    }
    # One line per flag: the snapshot diffs line by line when upstream changes.
    lines = ['{', f' "source": {json.dumps(data["source"])},', f' "commit": {json.dumps(commit)},',
             f' "modes": {json.dumps(data["modes"])},', ' "configs": {']
    for i, (name, pairs) in enumerate(data["configs"].items()):
        body = ",\n".join(f"   {json.dumps(pair)}" for pair in pairs)
        lines.append(f'  {json.dumps(name)}: [\n{body}\n  ]' + ("," if i < len(data["configs"]) - 1 else ""))
    lines += [' }', '}']
    with open(snapshot, "w") as f:
        f.write("\n".join(lines) + "\n")


def _int(pairs, flag, default=1):
    for k, v in pairs:
        if k == flag:
            return int(v)
    return default


def _has_layer_pattern(pairs) -> bool:
    return any(flag == "--moe-layer-freq" and not str(value).strip().isdigit() for flag, value in pairs)


def _tiny_text_dataset(tmp) -> str:
    """The path prefix of a one-document indexed dataset in ``tmp`` (written once)."""
    import numpy as np  # import cost: only lines with --fim-data need it

    from megatron.core.datasets import IndexedDatasetBuilder

    prefix = os.path.join(tmp, "fim_text")
    if not os.path.isfile(prefix + ".idx"):
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
        builder.add_item(np.array([20797, 287, 262, 3504, 50256] * 64))
        builder.end_document()
        builder.finalize(prefix + ".idx")
    return prefix


def command_line(pairs, tmp, model_parallel_at_one=False):
    """The substituted argv and the world size to parse it at."""
    from megatron.core.tokenizer import default_gpt2_vocab_files

    vocab, merges = default_gpt2_vocab_files()
    tp = _int(pairs, "--tensor-model-parallel-size")
    heads = max(SCALE["--num-attention-heads"], tp)
    # --fim-data rearranges text, so mock data cannot stand in for upstream's files: a tiny
    # real dataset (GPT-2 ids of "fill in the middle" and EOD) does.
    data = ["--data-path", _tiny_text_dataset(tmp)] if any(
        flag == "--fim-data" and value is True for flag, value in pairs) else ["--mock-data"]
    argv = [*data, "--num-workers", "0"]
    if ["--tokenizer-type", "NullTokenizer"] not in pairs:
        argv += ["--vocab-file", vocab, "--merge-file", merges]
    for flag, value in pairs:
        if (flag in DATA_FLAGS and value != "NullTokenizer") or _dropped(flag):
            continue
        if model_parallel_at_one and (flag in PIPELINE_OR_CONTEXT or _pipeline_only(flag)):
            continue
        if flag == "--num-attention-heads":
            value = heads
        elif flag == "--num-query-groups":
            value = max(2, tp)
        elif flag == "--num-layers" and _int(pairs, "--pipeline-model-parallel-size") > 1 and not model_parallel_at_one:
            pass  # the pipeline's layer split (virtual stages, uneven stages) is upstream's: keep its layers
        elif flag == "--num-layers" and _has_layer_pattern(pairs):
            pass  # a --moe-layer-freq pattern has one entry per layer: keep upstream's layer count
        elif flag in SCALE:
            value = SCALE[flag]
        elif flag == "--global-batch-size":
            value = None  # set below from the data-parallel size
        elif isinstance(value, str):
            value = re.sub(r"\$\{([A-Z_]+)\}", lambda m: VARIABLES.get(m.group(1), tmp), SUBSTITUTE.get(value, value))
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif _takes_list(flag):
            if isinstance(value, str) and value.startswith("[") and value.endswith("]"):
                value = value[1:-1]  # upstream's launcher strips [ ] from list values (_run_training.sh)
            argv += [flag, *str(value).split()]  # "--data-path: 0.3 a 0.7 b" is several arguments
        else:
            argv += [flag, str(value)]
    pp = 1 if model_parallel_at_one else _int(pairs, "--pipeline-model-parallel-size")
    cp = 1 if model_parallel_at_one else _int(pairs, "--context-parallel-size")
    world = math.lcm(8, tp * pp * cp)
    dp = world // (tp * pp * cp)
    if any(flag == "--global-batch-size" for flag, _ in pairs):
        # Two microbatches per step, or what the interleaved schedule needs: whole groups of
        # (by default) the pipeline size per virtual stage.
        group = _int(pairs, "--microbatch-group-size-per-virtual-pipeline-stage") if any(
            flag == "--microbatch-group-size-per-virtual-pipeline-stage" for flag, _ in pairs) else pp
        microbatches = 2 if pp == 1 else 2 * group
        argv += ["--global-batch-size", str(microbatches * dp)]
    return argv, world


def _without(argv, flags):
    """``argv`` less ``flags`` and their values."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg in flags:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        else:
            out.append(arg)
    return out


def try_parse(argv, world, missing=None):
    """The parse's error message, or None. A flag whose optional package is not installed
    here (``MissingExtra``: TensorBoard, W&B) says nothing about the trainer's flags: the
    line is parsed again without it, and the extra is added to ``missing`` (a set)."""
    from megatron.core.extras import MissingExtra  # imported here, as parse_args: after sys.path is set
    from megatron.training.arguments import parse_args

    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            parse_args(argv, world_size=world, cuda_available=False)
    except MissingExtra as e:
        if missing is None or not e.flags or not set(e.flags) & set(argv):
            return str(e)
        missing.add((e.extra, e.package))
        return try_parse(_without(argv, e.flags), world, missing)
    except (ValueError, SystemExit) as e:
        return str(e) or repr(e)
    return None


def rejection_key(message: str) -> str:
    match = re.search(r"--[a-z0-9][a-z0-9_-]*", message)
    return match.group(0) if match else message[:60]


def replay(configs, verbose=False, missing=None):
    """(counts, {flag: [config names]}) over the training configurations. ``missing``
    (a set), when given, collects the (extra, package) pairs not installed here whose flags
    were left out of the lines (the counts are then what an install with them gives)."""
    counts = collections.Counter()
    rejections = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (mode, pairs) in sorted(configs.items()):
            if mode in SKIPPED_MODES:
                counts["skipped (MODE inference/rl)"] += 1
                continue
            counts["training lines"] += 1
            argv, world = command_line(pairs, tmp)
            error = try_parse(argv, world, missing)
            if error is None:
                counts["accepted"] += 1
                continue
            pp_or_cp = _int(pairs, "--pipeline-model-parallel-size") > 1 or _int(pairs, "--context-parallel-size") > 1
            if pp_or_cp:
                argv1, world1 = command_line(pairs, tmp, model_parallel_at_one=True)
                error1 = try_parse(argv1, world1, missing)
                if error1 is None:
                    counts["blocked by PP/CP"] += 1
                    continue
                error = error1
            counts["rejected"] += 1
            rejections[rejection_key(error)].append(name)
            if verbose:
                print(f"{name}: {error}")
    return counts, rejections


def missing_note(missing) -> str:
    """One line: which optional packages were missing, and the extra that installs them."""
    from megatron.core.extras import install_command  # imported here, as parse_args: after sys.path is set

    extras = ",".join(sorted({extra for extra, _ in missing}))
    packages = ", ".join(sorted(package for _, package in missing))
    return (f"note: {packages} not installed: the flags that need it were left out of the lines (the counts are "
            f"those of an install with it); install with `{install_command(extras)}`")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verbose", action="store_true", help="print every rejection's message")
    p.add_argument("--write-snapshot", action="store_true", help="refresh upstream_gpt_configs.json from the mirror")
    p.add_argument("--snapshot", action="store_true", help="read the snapshot even where the mirror exists")
    p.add_argument("--suite", choices=sorted(SUITES), default="gpt",
                   help="upstream's test_cases folder: gpt (default) or moe")
    p.add_argument("--top", type=int, default=25)
    opts = p.parse_args(argv)
    cases, snapshot = SUITES[opts.suite]
    if os.path.isdir(MIRROR) and not opts.snapshot:
        commit, configs = load_from_mirror(cases)
        source = f"mirror {MIRROR} at {commit[:12]}"
        if opts.write_snapshot:
            write_snapshot(commit, configs, snapshot, cases)
    else:
        commit, configs = load_snapshot(snapshot)
        source = f"snapshot {os.path.relpath(snapshot, REPO)} ({commit[:12]})"
    missing = set()
    counts, rejections = replay(configs, opts.verbose, missing)
    print(f"source: {source}; {len(configs)} {opts.suite.upper()} configurations")
    if missing:
        print(missing_note(missing))
    for key in ("skipped (MODE inference/rl)", "training lines", "accepted", "blocked by PP/CP", "rejected"):
        print(f"{key}: {counts[key]}")
    print("\nremaining rejections (flag -> lines):")
    for flag, names in sorted(rejections.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:opts.top]:
        print(f"  {len(names):4d}  {flag}")
    return counts, rejections


if __name__ == "__main__":
    main()
