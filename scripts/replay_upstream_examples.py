"""Upstream Megatron-LM's ``examples/`` launch scripts that run pretrain_gpt.py, replayed here.

Each script is executed by bash exactly as upstream ships it (its own variables, defaults,
arrays and sourced files), with stub ``torchrun``/``python``/``srun``/``sbatch`` commands that
record the argv handed to pretrain_gpt.py instead of starting anything. The argv lands in
tests/upstream_lines/upstream_example_scripts.json (``--write-snapshot``, needs the mirror),
so CI replays it without the mirror.

Each argv then gets the CPU substitutions of scripts/replay_upstream_configs.py (gloo, local
layers, FP8 / NCCL user-buffer flags dropped, mock data and the GPT-2 tokenizer files, a tiny
model) and is parsed at the script's own TP/PP/CP/EP layout. ``--train`` also runs each
accepted script for 3 iterations with torch.distributed.run on at most 8 CPU ranks: where
the layout needs more than 8, the parallel sizes are halved (largest first) until it fits,
and the table says so.

    python scripts/replay_upstream_examples.py [--snapshot | --write-snapshot] [--train [NAME ...]]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import replay_upstream_configs as lines  # noqa: E402  (scripts/ is not a package)

REPO = lines.REPO
MIRROR = lines.MIRROR
SNAPSHOT = os.path.join(REPO, "tests", "upstream_lines", "upstream_example_scripts.json")
SC21 = "examples/academic_paper_scripts/sc21"

# name -> (script run by bash, files it sources (copied next to it), environment, positional
# arguments). Values stand in for what a user fills in: paths, and SC21's <placeholders>.
EXAMPLES = {
    "gpt3_175b": ("examples/gpt3/train_gpt3_175b_distributed.sh", (), {},
                  ["ckpt", "tensorboard", "gpt2-vocab.json", "gpt2-merges.txt", "data_text_document"]),
    "llama3_8b_fp8": ("examples/llama/train_llama3_8b_h100_fp8.sh", (), {}, []),
    "llama3_8b_mfsdp_fp8": ("examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh", (), {"USE_UV": "0"}, []),
    "deepseek_v3_mfsdp": ("examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh", (),
                          {"OUTPUT_PATH": "out", "DATA_PATH": "data_text_document", "MEGATRON_PATH": "megatron"}, []),
    "mixtral_8x7b": ("examples/mixtral/train_mixtral_8x7b_distributed.sh", (), {},
                     ["ckpt", "tokenizer.model", "data_text_document"]),
    "gptoss": ("examples/gptoss/02_train.sh", (), {}, ["--checkpoint-path", "."]),
}
SC21_RUNS = ("run_figure_11", "run_figure_12", "run_figure_13", "run_figure_14", "run_figure_15",
             "run_figure_16", "run_figure_17", "run_figure_18", "run_table_1")
for _run in SC21_RUNS:
    EXAMPLES["sc21_" + _run] = (f"{SC21}/{_run}.sh", (f"{SC21}/CONFIG.sh", f"{SC21}/SBATCH.sh", f"{SC21}/SRUN.sh"),
                                {}, [])
# Refused, with the one line the table prints.
REFUSED = {
    "modelopt_train": ("examples/post_training/modelopt/train.sh",
                       "ModelOpt post-training (--modelopt-enabled, --export-te-mcore-model, --sft on a Hugging "
                       "Face checkpoint) is not built here"),
}

# Every launcher ends in `python ... pretrain_gpt.py ARGS`: the stubs record ARGS, NUL-separated.
STUBS = r"""
python() { while [ $# -gt 0 ]; do case "$1" in */pretrain_gpt.py|pretrain_gpt.py) shift; printf '%s\0' "$@" > "$REPLAY_OUT"; return 0;; esac; shift; done; }
torchrun() { python "$@"; }
srun() { while [ $# -gt 0 ]; do case "$1" in python|bash) "$@"; return;; sh) shift; bash "$@"; return;; esac; shift; done; }
sbatch() { local last="${@: -1}"; if [ -f "$last" ]; then bash "$last"; else bash -s; fi; }
uv() { shift; "$@"; }
git() { :; }
export -f python torchrun srun sbatch uv git
"""


def _git(*args):
    return subprocess.run(["git", "-C", MIRROR, *args], check=True, capture_output=True, text=True).stdout


def capture(script, sources, env, positional):
    """The argv the script hands to pretrain_gpt.py (bash runs it in a scratch directory)."""
    with tempfile.TemporaryDirectory() as work:
        for path in (script, *sources):
            text = _git("show", f"HEAD:{path}")
            # SC21's CONFIG.sh leaves <placeholders> for the user to fill in.
            text = re.sub(r"=<[^>\n]*>", "=placeholder", text)
            with open(os.path.join(work, os.path.basename(path)), "w") as f:
                f.write(text)
        open(os.path.join(work, "pretrain_gpt.py"), "w").close()  # the scripts check that it exists
        out = os.path.join(work, "argv.bin")
        environ = {"PATH": os.environ["PATH"], "HOME": work, "REPLAY_OUT": out, **env}
        command = STUBS + f'\nsource ./{os.path.basename(script)} "$@"'
        subprocess.run(["bash", "-c", command, "replay", *positional], cwd=work, env=environ,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        if not os.path.exists(out):
            raise RuntimeError(f"{script} never reached pretrain_gpt.py")
        with open(out) as f:
            return [arg.replace(work, "$WORK") for arg in f.read().split("\0")[:-1]]


def load_from_mirror():
    commit = _git("rev-parse", "HEAD").strip()
    return commit, {name: {"script": spec[0], "argv": capture(*spec)} for name, spec in EXAMPLES.items()}


def load_snapshot(snapshot=SNAPSHOT):
    with open(snapshot) as f:
        data = json.load(f)
    return data["commit"], data["scripts"]


def write_snapshot(commit, scripts, snapshot=SNAPSHOT):
    lines_out = ["{", ' "source": "NVIDIA/Megatron-LM examples/ launch scripts: the argv each hands to '
                 'pretrain_gpt.py (scripts/replay_upstream_examples.py --write-snapshot)",',
                 f' "commit": {json.dumps(commit)},', ' "scripts": {']
    for i, (name, entry) in enumerate(sorted(scripts.items())):
        lines_out.append(f'  {json.dumps(name)}: {{"script": {json.dumps(entry["script"])}, "argv": '
                         f'{json.dumps(entry["argv"])}}}' + ("," if i < len(scripts) - 1 else ""))
    lines_out += [" }", "}"]
    with open(snapshot, "w") as f:
        f.write("\n".join(lines_out) + "\n")


def to_pairs(argv):
    """[[flag, value]] as the functional-test yaml has them: a flag's values joined by spaces,
    True for a switch."""
    pairs = []
    for arg in argv:
        if re.fullmatch(r"--[A-Za-z][A-Za-z0-9_-]*", arg):
            pairs.append([arg, True])
        elif pairs:
            flag, value = pairs[-1]
            pairs[-1][1] = arg if value is True else f"{value} {arg}"
    return pairs


def _value(pairs, flag, default=None):
    for k, v in pairs:
        if k == flag:
            return v
    return default


def layout(pairs):
    """(tp, pp, cp, ep, etp) as the script sets them."""
    tp = int(_value(pairs, "--tensor-model-parallel-size", 1))
    ep = int(_value(pairs, "--expert-model-parallel-size", 1))
    return (tp, int(_value(pairs, "--pipeline-model-parallel-size", 1)),
            int(_value(pairs, "--context-parallel-size", 1)), ep,
            int(_value(pairs, "--expert-tensor-parallel-size", tp)) if ep > 1 else 1)


def world_size(tp, pp, cp, ep, etp):
    """The smallest launch of at least 8 ranks that holds the layout: dense ranks tp*cp*dp and
    expert ranks ep*etp*expert_dp per pipeline stage."""
    world = math.lcm(8, tp * pp * cp)
    while (world // pp) % (ep * etp):
        world += math.lcm(8, tp * pp * cp)
    return world


def describe(tp, pp, cp, ep, etp):
    return f"TP{tp} PP{pp} CP{cp} EP{ep}" + (f" ETP{etp}" if ep > 1 and etp != tp else "")


def parse_line(pairs, tmp):
    """(argv, world) with the CPU substitutions at the script's own layout."""
    argv, _ = lines.command_line(pairs, tmp)
    world = world_size(*layout(pairs))
    tp, pp, cp, _, _ = layout(pairs)
    if "--global-batch-size" in argv:  # two microbatches per data-parallel rank (more for VPP)
        i = argv.index("--global-batch-size")
        group = 2 if pp == 1 else 2 * pp
        argv[i + 1] = str(group * (world // (tp * pp * cp)))
    return argv, world


def capped(tp, pp, cp, ep, etp, limit=8):
    """The layout trained on ``limit`` ranks: each size kept to its largest power-of-two
    divisor, then the largest of TP/PP/CP halved until one launch of ``limit`` ranks holds it."""
    sizes = {"tp": tp & -tp, "pp": pp & -pp, "cp": cp & -cp}
    while sizes["tp"] * sizes["pp"] * sizes["cp"] > limit:
        key = max(sizes, key=sizes.get)
        sizes[key] //= 2
    per_stage = limit // sizes["pp"]
    ep, etp = ep & -ep, etp & -etp
    while ep * etp > per_stage:
        if ep >= etp:
            ep //= 2
        else:
            etp //= 2
    return sizes["tp"], sizes["pp"], sizes["cp"], ep, etp


def train_line(pairs, tmp, limit=8):
    """(argv, world, layout) for 3 iterations of the script's line on ``limit`` ranks: its
    layout capped to fit, then replay_upstream_configs.train_command (one owner of the CPU
    command for both replays)."""
    tp, pp, cp, ep, etp = capped(*layout(pairs), limit=limit)
    # Under PP two layers per stage (with VPP: two chunks of one layer); at PP 1 the
    # functional-test replay's 4 layers (DeepSeek-V3's layer pattern keeps 2).
    num_layers = 2 * pp
    sizes = {"--tensor-model-parallel-size": tp, "--pipeline-model-parallel-size": pp,
             "--context-parallel-size": cp, "--expert-model-parallel-size": ep,
             "--expert-tensor-parallel-size": etp, "--num-layers": num_layers,
             "--num-layers-per-virtual-pipeline-stage": 1 if pp > 1 else None}
    out = []
    for flag, value in pairs:
        if flag in sizes:
            value = sizes[flag]
        elif flag == "--moe-layer-freq" and not str(value).strip().isdigit():
            value = f"[0]*1+[1]*{num_layers - 1}"  # DeepSeek-V3's dense first layers, then MoE
        elif flag in ("--save-interval", "--load", "--save"):
            value = None  # no checkpoint: the launch scripts' paths are the user's
        if value is not None:
            out.append([flag, value])
    argv, world = lines.train_command(out, tmp, world=limit)
    return argv, world, (tp, pp, cp, ep, etp)


def replay(scripts):
    """{name: (layout, world, error or None)} over the snapshot's scripts."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, entry in sorted(scripts.items()):
            pairs = to_pairs([a.replace("$WORK", tmp) for a in entry["argv"]])
            argv, world = parse_line(pairs, tmp)
            results[name] = (layout(pairs), world, lines.try_parse(argv, world))
    return results


def train(name, entry, limit=8, timeout=900):
    """(layout, [losses], seconds, error) for 3 iterations of the script's line."""
    with tempfile.TemporaryDirectory() as tmp:
        pairs = to_pairs([a.replace("$WORK", tmp) for a in entry["argv"]])
        argv, world, trained = train_line(pairs, tmp, limit)
        run = lines.run_training(argv, world, tmp, timeout)
    error = None if run["returncode"] == 0 and len(run["losses"]) == 3 else run["output"][-3000:]
    return trained, run["losses"], run["seconds"], error


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write-snapshot", action="store_true", help="refresh the snapshot from the mirror")
    p.add_argument("--snapshot", action="store_true", help="read the snapshot even where the mirror exists")
    p.add_argument("--train", nargs="*", default=None, metavar="NAME",
                   help="also train each accepted script (or the named ones) 3 iterations on <= 8 ranks")
    p.add_argument("--verbose", action="store_true")
    opts = p.parse_args(argv)
    if os.path.isdir(MIRROR) and not opts.snapshot:
        commit, scripts = load_from_mirror()
        if opts.write_snapshot:
            write_snapshot(commit, scripts)
    else:
        commit, scripts = load_snapshot()
    results = replay(scripts)
    print(f"upstream {commit[:12]}: {len(scripts)} launch scripts, "
          f"{sum(r[2] is None for r in results.values())} parse at their own layout; "
          f"{len(REFUSED)} refused")
    print(f"{'script':22s} {'layout':22s} {'ranks':>5s}  parse")
    for name, (own, world, error) in results.items():
        print(f"{name:22s} {describe(*own):22s} {world:5d}  {'ok' if error is None else error}")
    for name, (script, reason) in REFUSED.items():
        print(f"{name:22s} {'-':22s} {'-':>5s}  refused: {reason}")
    if opts.train is not None:
        names = opts.train or [n for n, r in results.items() if r[2] is None]
        print(f"\n{'script':22s} {'trained at':22s} {'s':>5s}  losses (3 iterations)")
        for name in names:
            trained, losses, seconds, error = train(name, scripts[name])
            shown = " ".join(f"{x:.4f}" for x in losses) if error is None else "FAILED"
            print(f"{name:22s} {describe(*trained):22s} {seconds:5.0f}  {shown}", flush=True)
            if error and opts.verbose:
                print(error)
    return results


if __name__ == "__main__":
    main()
