"""How many of upstream Megatron-LM's GPT functional-test command lines this trainer accepts.

Reads every ``tests/functional_tests/test_cases/gpt/*/model_config.yaml`` of the upstream
mirror (a bare git repository, read with ``git show``), or, without the mirror, the
snapshot of their MODEL_ARGS in tests/upstream_lines/upstream_gpt_configs.json
(``--write-snapshot`` refreshes it from the mirror). Inference and RL configurations
(MODE inference/rl) are skipped: they do not run pretrain_gpt.py.

Each line gets the CPU substitutions (gloo for nccl, the local layers for Transformer
Engine, FP8 / NCCL user-buffer / TP-comm-overlap flags dropped), mock data (a tiny real
dataset for --fim-data) and the GPT-2 tokenizer instead of files that are not here, and a
tiny model, but keeps its TP/PP/CP sizes; parse_args then runs at the world size upstream launches (8 ranks, or more when
the model-parallel sizes need it). A line rejected only because of PP/CP > 1 (it parses
with those sizes at 1 and the pipeline-only flags dropped) counts as "blocked by PP/CP".

``--train`` runs lines instead of parsing them: TRAINED_SAMPLE (or the named lines of
``--suite``), 3 iterations each at the line's own TP/PP/CP/EP on the fewest CPU ranks that
hold it, and prints their layouts, seconds and losses (tests/upstream_lines asserts them).

    python scripts/replay_upstream_configs.py [--verbose] [--snapshot | --write-snapshot]
    python scripts/replay_upstream_configs.py --train [--suite moe NAME ...]
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
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, REPO)
MIRROR = "/work/.mirror/NVIDIA+Megatron-LM/repo"
CASES = "tests/functional_tests/test_cases/gpt"
SNAPSHOT = os.path.join(REPO, "tests", "upstream_lines", "upstream_gpt_configs.json")
# Upstream's MoE recipes (DeepSeek-V3, Qwen-MoE, Mixtral) live in their own folder: --suite moe.
SUITES = {
    "gpt": (CASES, SNAPSHOT),
    "moe": ("tests/functional_tests/test_cases/moe",
            os.path.join(REPO, "tests", "upstream_lines", "upstream_moe_configs.json")),
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
        argv += ["--global-batch-size", str(_microbatches(pairs, pp) * dp)]
    return argv, world


def _microbatches(pairs, pp):
    """Two microbatches per step, or what the interleaved schedule needs: whole groups of
    (by default) the pipeline size per virtual stage."""
    group = _int(pairs, "--microbatch-group-size-per-virtual-pipeline-stage") if any(
        flag == "--microbatch-group-size-per-virtual-pipeline-stage" for flag, _ in pairs) else pp
    return 2 if pp == 1 else 2 * group


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


# ---- Training a line: 3 iterations at its own TP/PP/CP/EP on CPU ranks -------------------

# A fixed sample of upstream's lines trained by tests/upstream_lines (suite, name): the
# parallel layouts (PP, PP with virtual stages and uneven stages, CP, TP with sequence
# parallelism, EP with and without TP, expert TP apart from TP) and the newer blocks
# (multi-latent attention, the gated delta net, MoE with each router and load balancing).
TRAINED_SAMPLE = (
    ("gpt", "gpt3_mcore_te_tp1_pp4_swiglu"),
    ("gpt", "gpt3_mcore_te_tp1_pp4_untie_embeddings_and_outputs"),
    ("gpt", "gpt3_mcore_te_tp1_pp4_vp1_uneven_pipeline"),
    ("gpt", "gpt3_mcore_te_tp1_pp4_vp1"),
    ("gpt", "gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce"),
    ("gpt", "gpt3_mcore_te_tp1_pp4_vp1_tunable_overlap"),
    ("gpt", "gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split"),
    ("gpt", "gpt3_mcore_te_tp2_pp1_cp2_nondeterministic"),
    ("gpt", "gpt3_mcore_te_tp2_pp2_cp2"),
    ("gpt", "gpt3_mcore_te_tp4_pp1_dist_optimizer_overlap_grad_reduce_param_gather"),
    ("gpt", "gpt3_mcore_te_tp4_pp1_qk_layernorm_test_mode"),
    ("gpt", "gpt3_mcore_te_tp2_pp2"),
    ("gpt", "gpt3_mcore_te_tp2_pp2_defer_embedding_wgrad_compute"),
    ("gpt", "gpt3_mcore_te_tp2_pp2_mla"),
    ("gpt", "gpt3_mcore_te_tp2_pp1_gdn"),
    ("moe", "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_dist_optimizer"),
    ("moe", "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_top2router"),
    ("moe", "gpt3_mcore_te_tp2_pp1_te_8experts_etp1_ep4"),
    ("moe", "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer_1node"),
    ("moe", "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_resume_torch_dist_dist_optimizer_1node"),
    ("moe", "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph_1node"),
    ("moe", "gpt3_mcore_tp2_pp2_resume_torch_dist_te_2experts"),
    ("moe", "deepseek_proxy_fsdp_ep2_fsdp2"),
    ("moe", "gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_no_mtp_no_a2a_ovlp_fine_grained_offloading"),
)

# What a trained line shrinks beyond SCALE: the experts, MLA's ranks, the vocabulary.
TRAIN_SCALE = {"--moe-ffn-hidden-size": 64, "--moe-shared-expert-intermediate-size": 64,
               "--q-lora-rank": 32, "--kv-lora-rank": 32, "--qk-head-dim": 16, "--qk-pos-emb-head-dim": 8,
               "--v-head-dim": 16, "--make-vocab-size-divisible-by": 128, "--vocab-size": 512}
# 3 iterations: no evaluation; the NullTokenizer's vocabulary replaces the line's.
NOT_TRAINED = ("--eval-interval", "--tokenizer-type", "--vocab-size",
               "--global-batch-size")
# Sample counts that would override --train-iters.
TRAIN_DROPPED = ("--train-samples", "--lr-decay-samples", "--lr-warmup-samples", "--exit-duration-in-mins",
                 "--step-batch-size-schedule", "--lr-warmup-fraction")


def layout(pairs):
    """(tp, pp, cp, ep, etp) as the line sets them (the expert TP size defaults to TP's)."""
    tp = _int(pairs, "--tensor-model-parallel-size")
    ep = _int(pairs, "--expert-model-parallel-size")
    return (tp, _int(pairs, "--pipeline-model-parallel-size"), _int(pairs, "--context-parallel-size"), ep,
            _int(pairs, "--expert-tensor-parallel-size", tp) if ep > 1 else 1)


def virtual_stages(pairs):
    """The virtual pipeline stages per rank the line asks for (1: not interleaved)."""
    pp = _int(pairs, "--pipeline-model-parallel-size")
    if pp == 1:
        return 1
    for flag, value in pairs:
        if flag == "--num-virtual-stages-per-pipeline-rank":
            return int(value)
        if flag == "--num-layers-per-virtual-pipeline-stage":
            return _int(pairs, "--num-layers") // (pp * int(value))
        if flag == "--pipeline-model-parallel-layout":
            # Upstream's layout string: stages split by '|', '(...)*n' and 'x*n' repeat.
            expanded = str(value)
            while re.search(r"\([^()]*\)\*\d+", expanded):
                expanded = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), expanded)
            return (expanded.count("|") + 1) // pp
    return 1


def train_world(tp, pp, cp, ep, etp):
    """The fewest ranks that hold the layout: a multiple of tp*pp*cp whose ranks per pipeline
    stage (tp*cp*dp) also hold ep*etp expert ranks. The data-parallel size is what is left."""
    world = tp * pp * cp
    while (world // pp) % (ep * etp):
        world += tp * pp * cp
    return world


def train_command(pairs, tmp, world=None):
    """(argv, world) for 3 iterations of the line, at the parallel sizes its pairs carry, on
    ``world`` ranks (default: train_world's fewest): command_line's CPU substitutions and tiny
    model, TRAIN_SCALE's, mock data with the NullTokenizer, two microbatches per data-parallel
    rank (whole groups for the interleaved schedule), a loss line per iteration."""
    tp, pp, cp, ep, etp = layout(pairs)
    world = world or train_world(tp, pp, cp, ep, etp)
    out = []
    for flag, value in pairs:
        if flag in NOT_TRAINED:
            continue
        if flag == "--num-experts":
            groups = _int(pairs, "--moe-router-num-groups")
            value = min(int(value), math.lcm(16, ep, groups))
        elif flag in TRAIN_SCALE:
            value = TRAIN_SCALE[flag]
        out.append([flag, value])
    out += [["--tokenizer-type", "NullTokenizer"], ["--vocab-size", TRAIN_SCALE["--vocab-size"]]]
    argv, _ = command_line(out, tmp)
    argv += ["--global-batch-size", str(_microbatches(pairs, pp) * (world // (tp * pp * cp)))]
    for flag in TRAIN_DROPPED:
        argv = _drop(argv, flag)
    for flag, value in (("--train-iters", "3"), ("--eval-iters", "0"), ("--log-interval", "1")):
        argv = _set(argv, flag, value)
    return argv, world


def _drop(argv, flag):
    """``argv`` less ``flag`` and its values."""
    if flag not in argv:
        return argv
    i = argv.index(flag)
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return argv[:i] + argv[j:]


def _set(argv, flag, value):
    return _drop(argv, flag) + [flag, value]


ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?\| lm loss: (\S+) \|")


def run_training(argv, world, tmp, timeout=600, launch=None):
    """Runs pretrain_gpt.py on ``world`` CPU ranks (torch.distributed.run, gloo; or
    ``launch(argv, world, env, timeout) -> (returncode, output)``, the test suite's faster
    launcher): {"iterations": [(iteration, of), ...] and "losses" [lm loss] of its iteration
    lines, "model": its "> model:" line, "seconds", "returncode", "output": the ranks' stdout
    and stderr}. A run past ``timeout`` is killed with its ranks (returncode None, or the
    launcher's)."""
    import signal  # only the training mode kills process groups

    argv = _set(argv, "--log-dir", os.path.join(tmp, "logs"))
    if "--tensorboard-dir" in argv:
        argv = _set(argv, "--tensorboard-dir", os.path.join(tmp, "tb"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONPATH=REPO, CUDA_VISIBLE_DEVICES="")
    start = time.time()
    if launch is not None:
        returncode, output = launch(argv, world, env, timeout)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               "pretrain_gpt.py", *argv]
        # A session of its own: a hung run is killed with every rank it started.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            returncode = None
    model = next((line for line in output.splitlines() if line.startswith("> model:")), "")
    iterations = list(ITERATION.finditer(output))
    return {"iterations": [(int(m.group(1)), int(m.group(2))) for m in iterations],
            "losses": [float(m.group(3)) for m in iterations], "model": model,
            "seconds": time.time() - start, "returncode": returncode, "output": output}


def expected_layout(pairs, world):
    """The phrases the "> model:" line of the trained line must hold (training.py's wording)."""
    tp, pp, cp, ep, etp = layout(pairs)
    phrases = [f"world size {world}"]
    if tp > 1:
        phrases.append(f"tensor parallel {tp} x data parallel {world // (tp * pp * cp)}")
    if pp > 1:
        vp = virtual_stages(pairs)
        phrases.append(f"pipeline parallel {pp}" + (f" x {vp} virtual stages" if vp > 1 else " (1F1B)"))
    if cp > 1:
        phrases.append(f"context parallel {cp}")
    if ep > 1:
        phrases.append(f"expert parallel {ep} x expert tensor parallel {etp}")
    return phrases


def load_line(suite, name):
    """The MODEL_ARGS pairs of one line, from the snapshot (CI has no mirror)."""
    _, configs = load_snapshot(SUITES[suite][1])
    return configs[name][1]


def train(suite, name, timeout=600, launch=None):
    """run_training's result for one line of the snapshot, with "layout", "world" and "expected"."""
    pairs = load_line(suite, name)
    with tempfile.TemporaryDirectory() as tmp:
        argv, world = train_command(pairs, tmp)
        result = run_training(argv, world, tmp, timeout, launch)
    return dict(result, layout=layout(pairs), world=world, expected=expected_layout(pairs, world))


def describe(tp, pp, cp, ep, etp):
    return f"TP{tp} PP{pp} CP{cp} EP{ep}" + (f" ETP{etp}" if ep > 1 and etp != tp else "")


def train_table(lines):
    """Trains each (suite, name) and prints one row per line; the rows, as train returns them."""
    print(f"{'line':80s} {'layout':20s} {'ranks':>5s} {'s':>5s}  losses (3 iterations)", flush=True)
    rows = []
    for suite, name in lines:
        row = train(suite, name)
        ok = row["returncode"] == 0 and len(row["losses"]) == 3 and all(p in row["model"] for p in row["expected"])
        shown = " ".join(f"{x:.4f}" for x in row["losses"]) if ok else "FAILED: " + row["output"][-2000:]
        print(f"{suite + '/' + name:80s} {describe(*row['layout']):20s} {row['world']:5d} {row['seconds']:5.0f}  "
              f"{shown}", flush=True)
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verbose", action="store_true", help="print every rejection's message")
    p.add_argument("--write-snapshot", action="store_true", help="refresh upstream_gpt_configs.json from the mirror")
    p.add_argument("--snapshot", action="store_true", help="read the snapshot even where the mirror exists")
    p.add_argument("--suite", choices=sorted(SUITES), default="gpt",
                   help="upstream's test_cases folder: gpt (default) or moe")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--train", nargs="*", default=None, metavar="NAME",
                   help="train TRAINED_SAMPLE's lines (or the named lines of --suite) 3 iterations each at "
                        "their own layout, from the snapshot, and print the table")
    opts = p.parse_args(argv)
    if opts.train is not None:
        return train_table([(opts.suite, name) for name in opts.train] or TRAINED_SAMPLE)
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
