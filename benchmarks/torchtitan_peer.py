"""The same Llama trained by torchtitan 0.3.0 (FSDP2) and by ``pretrain_gpt.py --use-mfsdp``
(ZeRO-3), side by side on CPU/gloo: step time, tokens/s, peak RSS per rank, loss curve.

    python benchmarks/torchtitan_peer.py --nproc 2 --shape small --steps 10 --rounds 2
    python benchmarks/torchtitan_peer.py --nproc 4 --shape small --steps 10 --rounds 2
    python benchmarks/torchtitan_peer.py --nproc 2 --shape small --variants eager,compiled
    python benchmarks/torchtitan_peer.py --nproc 2 --shape large --steps 4 --rounds 1
    python benchmarks/torchtitan_peer.py --nproc 2 --shape small --engines mfsdp,fsdp2 \
        --out benchmarks/results/torchtitan_peer_n2_small_engines.json
    python benchmarks/torchtitan_peer.py --report          # results/torchtitan_peer.md from the JSON files

Run with the project's environment. torchtitan lives in a virtual environment of its own,
``.venv-titan`` at the repository root, created on first use (``--setup-venv`` does only
that)::

    python3.11 -m venv .venv-titan
    .venv-titan/bin/pip install -c constraints.txt torch==2.13.0 torchtitan==0.3.0 triton==3.8.0

(torchtitan imports triton without declaring it; ``constraints.txt`` pins the CPU torch.)
torchtitan runs through ``benchmarks/torchtitan_cpu_launcher.py``, which holds every
run-time adjustment it needs on CPU (see its docstring); the project's code is not touched.

What is the same on both sides:

* **model**: Llama-3, untied embeddings, RoPE base 500000 (no frequency scaling), RMSNorm,
  SwiGLU, no biases, no dropout, causal SDPA. ``small`` is torchtitan's "debugmodel" (dim 256,
  6 layers, 16 heads, SwiGLU 768, vocab 2048: 6,163,712 parameters), sequence 512;
  ``large`` is dim 512, 8 layers, 8 heads, SwiGLU 1536, vocab 2048 (29,368,832 parameters),
  sequence 1024. Both parameter counts are checked on both sides before anything is timed.
* **tokens**: the quickstart's Shakespeare corpus (``tools/prepare_shakespeare.py
  --vocab-size 2048``: a 2048-entry byte-level BPE trained on the works), read once through
  the project's dataset builder exactly as ``pretrain_gpt.py`` reads it (same seed and
  split), written to a ``.npy`` file that torchtitan's launcher reads in Megatron's sampler
  order: every step both trainers see the same sequences on the same ranks.
* **recipe**: fp32, AdamW (lr 8e-4 constant, betas 0.9/0.95, eps 1e-8, weight decay 0.1;
  Megatron exempts the norm weights from decay, torchtitan does not; torch's fused kernel on
  both sides: torchtitan's default, ours ``--optimizer-implementation fused``, or ``foreach``
  with ``--optimizer-implementation foreach``, as every result before 2026-12-06 19:00 UTC), gradient clipping at
  1.0, 2 sequences per rank, no gradient accumulation, no recompute, one data-parallel
  dimension over all ranks (torchtitan: FSDP2 with its defaults; ours: ZeRO-3,
  ``--data-parallel-sharding-strategy optim_grads_params``), loss logged every step.
* **initial weights** (``--init``): ``own`` (the default) lets each trainer initialize by its
  own recipe (torchtitan's Llama-3: embedding std 1, output layer std dim^-1/2, depth-scaled
  projections; Megatron's: std 0.02, output projections 0.02/sqrt(2 layers)); ``torchtitan``
  starts both from torchtitan's initial weights: its launcher writes them once as a Hugging
  Face Llama directory (``--save-initial-hf``), torchtitan's runs load it back
  (``--load-initial-hf``), ours start from the project's import of it
  (``tools/checkpoint/convert.py --to mfsdp``, then ``--load DIR --finetune``). Then the two
  loss curves differ only by the trainers' arithmetic.
* **our engines** (``--engines``): ``mfsdp`` is ``--use-mfsdp`` (the row "ours"), ``fsdp2``
  is ``--use-torch-fsdp2`` (PyTorch's ``fully_shard`` under the same trainer, the row
  "ours_fsdp2"; it shards parameters, gradients and optimizer state like ZeRO-3, so it takes
  no sharding-strategy flag). Each is one more launch in every round, after torchtitan's.
* **variant** ``compiled``: torchtitan ``--compile.enable`` (each block and the loss) against
  ``--compile-layers inductor`` (each transformer layer). With both variants the JSON also
  holds the issue's goal ratio, each trainer at its best settings (``ratios["best"]``): the
  faster variant's pooled median on each side, and per round each side's faster variant.

Each run is one ``torch.distributed.run`` launch; runs are interleaved
(torchtitan, ours, torchtitan, ours, ... per variant, ``--rounds`` times), so drift of
the machine hits both alike. A step's time: torchtitan's ``train_step`` wall time after a
barrier, slowest rank (the launcher); ours: ``elapsed_time_per_iteration_ms`` of
``metrics.jsonl`` at ``--log-interval 1`` (rank 0's clock from one step's end to the next;
the ranks leave a step together at its last collective). The first ``--warmup`` steps of
every run are left out (the compiled variants compile there). Peak RSS per rank: each
process's ``ru_maxrss``, largest over the ranks (torchtitan: gathered by the launcher;
ours: ``peak_memory_mb`` of ``metrics.jsonl``, the same quantity).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

import pretrain_gpt  # noqa: E402
import step_floor  # noqa: E402  (benchmarks/, on sys.path as this script's directory)
from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.batch_size_schedule import train_samples_needed  # noqa: E402
from megatron.training.training import build_tokenizer_from_args  # noqa: E402
from tools.prepare_shakespeare import prepare_shakespeare_bpe  # noqa: E402

VENV = os.path.join(REPO, ".venv-titan")
RESULTS = os.path.join(HERE, "results")
CACHE = os.path.join(REPO, "data", "cache")

# step_floor.py's shapes, with the parameter count both trainers must build.
PARAMS = {"small": 6_163_712, "large": 29_368_832}
SHAPES = {name: dict(shape, params=PARAMS[name]) for name, shape in step_floor.SHAPES.items()}
MICRO_BATCH = step_floor.MICRO_BATCH
LR = 8e-4
VOCAB = 2048


def setup_venv() -> str:
    """torchtitan's interpreter, the virtual environment created if missing."""
    python = os.path.join(VENV, "bin", "python")
    if not os.path.exists(python):
        print(f"creating {VENV} (torch 2.13.0 CPU, torchtitan 0.3.0, triton 3.8.0) ...", flush=True)
        subprocess.run(["python3.11", "-m", "venv", VENV], check=True)
        subprocess.run([os.path.join(VENV, "bin", "pip"), "install", "-q", "-c", os.path.join(REPO, "constraints.txt"),
                        "torch==2.13.0", "torchtitan==0.3.0", "triton==3.8.0"], check=True)
    return python


def shakespeare():
    """(tokenizer directory, dataset prefix) of the quickstart corpus at vocabulary 2048."""
    return prepare_shakespeare_bpe(VOCAB, CACHE)


# Our trainer's sides: the row name in the results and the engine flags that make it.
ENGINES = {
    "mfsdp": ("ours", ["--use-mfsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]),
    "fsdp2": ("ours_fsdp2", ["--use-torch-fsdp2"]),
}
LABELS = {"torchtitan": "torchtitan (FSDP2)", "ours": "ours (MFSDP ZeRO-3)", "ours_fsdp2": "ours (torch FSDP2)"}


def ours_flags(shape: dict, world: int, steps: int, tokenizer: str, prefix: str, log_dir: str, compiled: bool,
               engine: str = "mfsdp", adam: str = "fused"):
    flags = (f"--num-layers {shape['layers']} --hidden-size {shape['dim']} --num-attention-heads {shape['heads']} "
             f"--ffn-hidden-size {shape['ffn']} --swiglu --normalization RMSNorm --position-embedding-type rope "
             f"--rotary-base 500000 --untie-embeddings-and-output-weights --disable-bias-linear "
             f"--seq-length {shape['seq']} --max-position-embeddings {shape['seq']} "
             f"--micro-batch-size {MICRO_BATCH} --global-batch-size {MICRO_BATCH * world} "
             f"--hidden-dropout 0 --attention-dropout 0 "
             f"--optimizer adam --lr {LR} --lr-decay-style constant --lr-warmup-iters 0 --weight-decay 0.1 "
             f"--adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --optimizer-implementation {adam} "
             f"--train-iters {steps} --log-interval 1 --eval-iters 0 --eval-interval {steps + 1} "
             f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tokenizer} --data-path {prefix} "
             f"--split 100,0,0 --num-workers 0 --seed 1234 "
             f"--log-dir {log_dir}").split() + ENGINES[engine][1]
    if compiled:
        flags += ["--compile-layers", "inductor"]
    return flags


def dump_tokens(shape_name: str, world: int, steps: int, tokenizer: str, prefix: str) -> tuple:
    """The samples pretrain_gpt.py trains on, in its order, as [samples, seq + 1] int32 in a
    .npy file (built once per shape, world size and step count); and our parameter count."""
    shape = SHAPES[shape_name]
    args = parse_args(ours_flags(shape, world, steps, tokenizer, prefix, "/tmp/unused", False), world_size=world,
                      cuda_available=False)
    tok = build_tokenizer_from_args(args)
    with torch.device("meta"):
        params = sum(p.numel() for p in pretrain_gpt.model_provider(args).parameters())
    path = os.path.join(CACHE, f"titan_peer_{shape_name}_n{world}_s{steps}.npy")
    if not os.path.exists(path):
        train, _, _ = pretrain_gpt.train_valid_test_datasets_provider(args, tok, [train_samples_needed(args), 0, 0])
        rows = []
        for i in range(train_samples_needed(args)):
            tokens, labels = (np.asarray(train[i][k]) for k in ("tokens", "labels"))
            rows.append(np.concatenate([tokens[:1], labels]).astype(np.int32))
            if not np.array_equal(tokens[1:], labels[:-1]):
                raise RuntimeError("labels are not the tokens shifted by one; the dump would not be what we train on")
        np.save(path, np.stack(rows))
    return path, params


def torchrun(python: str, nproc: int, script_and_args: list, env: dict, log: str) -> float:
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] + script_and_args
    start = time.time()
    with open(log, "w") as f:
        result = subprocess.run(command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        with open(log) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{' '.join(command[:8])} ... failed ({result.returncode}); log {log}:\n{tail}")
    return time.time() - start


def titan_args(steps: int, work: str, shape, tokens, tokenizer, tag) -> list:
    """torchtitan's launcher arguments for this model, tokens and recipe; its dump folder
    and result file are ``<work>/<tag>`` and ``<work>/<tag>.json``."""
    return [os.path.join(HERE, "torchtitan_cpu_launcher.py"), "--tokens", tokens, "--tokenizer", tokenizer,
            "--dim", str(shape["dim"]), "--layers", str(shape["layers"]), "--heads", str(shape["heads"]),
            "--vocab", str(shape["vocab"]), "--seq-len", str(shape["seq"]), "--local-batch-size", str(MICRO_BATCH),
            "--steps", str(steps), "--lr", str(LR), "--dump-folder", os.path.join(work, tag),
            "--out", os.path.join(work, f"{tag}.json")]


def shared_initial_weights(python, opts, shape, tokens, tokenizer, env) -> tuple:
    """``--init torchtitan``: torchtitan's initial weights written once as a Hugging Face Llama
    directory by its launcher, and imported by the project's converter into a checkpoint that
    ``pretrain_gpt.py --load ... --finetune`` starts from. Returns (HF directory, checkpoint)."""
    hf_dir, ckpt = os.path.join(opts.work, "initial_hf"), os.path.join(opts.work, "initial_mfsdp")
    for path in (hf_dir, ckpt):
        shutil.rmtree(path, ignore_errors=True)
    torchrun(python, opts.nproc,
             titan_args(opts.steps, opts.work, shape, tokens, tokenizer, "initial") + ["--save-initial-hf", hf_dir],
             env, os.path.join(opts.work, "initial.log"))
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "checkpoint", "convert.py"), "--input", hf_dir,
                    "--to", "mfsdp", "--output", ckpt, "--quiet"], check=True, stdout=subprocess.DEVNULL)
    return hf_dir, ckpt


def step_floor(opts, out: str) -> float:
    """benchmarks/step_floor.py at this shape and rank count: seconds a step's matrix products
    and attention take alone (the slowest of the copies run at once)."""
    subprocess.run([sys.executable, os.path.join(HERE, "step_floor.py"), "--shape", opts.shape, "--procs",
                    str(opts.nproc), "--reps", "5", "--out", out], check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["slowest"]["floor_s"]


def run_titan(python, opts, shape, tokens, tokenizer, compiled, env, tag):
    out = os.path.join(opts.work, f"{tag}.json")
    args = titan_args(opts.steps, opts.work, shape, tokens, tokenizer, tag)
    if compiled:
        args.append("--compile")
    if opts.initial_hf is not None:
        args += ["--load-initial-hf", opts.initial_hf]
    wall = torchrun(python, opts.nproc, args, env, os.path.join(opts.work, f"{tag}.log"))
    with open(out) as f:
        record = json.load(f)
    return dict(step_s=record["step_s"], losses=record["losses"], peak_rss_mb=max(record["peak_rss_mb_per_rank"]),
                params=record["params"], wall_s=wall)


def run_ours(opts, shape, tokenizer, prefix, compiled, env, tag, engine="mfsdp"):
    log_dir = os.path.join(opts.work, tag)
    shutil.rmtree(log_dir, ignore_errors=True)  # metrics.jsonl is appended to
    flags = ours_flags(shape, opts.nproc, opts.steps, tokenizer, prefix, log_dir, compiled, engine,
                       opts.optimizer_implementation)
    if opts.initial_checkpoint is not None:
        flags += ["--load", opts.initial_checkpoint, "--finetune"]
    wall = torchrun(sys.executable, opts.nproc, ["pretrain_gpt.py"] + flags, env, os.path.join(opts.work, f"{tag}.log"))
    records = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    train = sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["iteration"])
    return dict(step_s=[r["elapsed_time_per_iteration_ms"] / 1000.0 for r in train],
                losses=[r["lm_loss"] for r in train], peak_rss_mb=max(r["peak_memory_mb"] for r in train),
                wall_s=wall)


def summarize(runs: list, warmup: int, tokens_per_step: int) -> dict:
    measured = [t for run in runs for t in run["step_s"][warmup:]]
    median = statistics.median(measured)
    losses = runs[-1]["losses"]
    tail = losses[-min(3, len(losses)):]
    return dict(median_step_s=median, p25_p75_step_s=statistics.quantiles(measured, n=4)[::2] if len(measured) > 1
                else [median, median], tokens_per_s=tokens_per_step / median,
                peak_rss_mb=max(run["peak_rss_mb"] for run in runs), final_loss=losses[-1],
                final_loss_mean_last3=sum(tail) / len(tail), losses=losses,
                run_medians_s=[statistics.median(run["step_s"][warmup:]) for run in runs])


def main_run(opts) -> None:
    python = setup_venv()
    if opts.setup_venv:
        return
    shape = SHAPES[opts.shape]
    tokenizer, prefix = shakespeare()
    tokens, our_params = dump_tokens(opts.shape, opts.nproc, opts.steps, tokenizer, prefix)
    if our_params != shape["params"]:
        raise RuntimeError(f"pretrain_gpt.py builds {our_params:,} parameters for '{opts.shape}', "
                           f"expected {shape['params']:,}")
    opts.work = os.path.join(opts.work, f"n{opts.nproc}_{opts.shape}")
    os.makedirs(opts.work, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONPATH=REPO)
    titan_env = {k: v for k, v in env.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    opts.initial_hf = opts.initial_checkpoint = None
    if opts.init == "torchtitan":
        opts.initial_hf, opts.initial_checkpoint = shared_initial_weights(python, opts, shape, tokens, tokenizer,
                                                                          titan_env)
    variants = opts.variants.split(",")
    engines = opts.engines.split(",")
    ours_sides = [ENGINES[e][0] for e in engines]
    runs = {f"{side}_{v}": [] for v in variants for side in ["torchtitan"] + ours_sides}
    floors = []
    for r in range(opts.rounds):
        if opts.floor:
            floors.append(step_floor(opts, os.path.join(opts.work, f"floor_r{r}.json")))
            print(f"round {r} floor (products alone, benchmarks/step_floor.py): {floors[-1]:.3f} s", flush=True)
        for v in variants:
            compiled = v == "compiled"
            tag = f"torchtitan_{v}"
            result = run_titan(python, opts, shape, tokens, tokenizer, compiled, titan_env, f"{tag}_r{r}")
            if result["params"] != shape["params"]:
                raise RuntimeError(f"torchtitan builds {result['params']:,} parameters, expected {shape['params']:,}")
            runs[tag].append(result)
            for engine in engines:
                side = ENGINES[engine][0]
                runs[f"{side}_{v}"].append(run_ours(opts, shape, tokenizer, prefix, compiled, env,
                                                    f"{side}_{v}_r{r}", engine))
            for name in [tag] + [f"{side}_{v}" for side in ours_sides]:
                last = runs[name][-1]
                print(f"round {r} {name}: median step {statistics.median(last['step_s'][opts.warmup:]):.3f} s, "
                      f"final loss {last['losses'][-1]:.4f}, peak RSS {last['peak_rss_mb']:.0f} MB, "
                      f"launch {last['wall_s']:.0f} s", flush=True)
    tokens_per_step = MICRO_BATCH * opts.nproc * shape["seq"]
    summary = {name: summarize(rs, opts.warmup, tokens_per_step) for name, rs in runs.items()}
    ratios = {}
    if floors:  # each round's floor against that round's eager torchtitan step
        titan_runs = runs.get("torchtitan_eager") or runs[f"torchtitan_{variants[0]}"]
        ratios["floor"] = dict(floor_s=floors, per_round_floor_over_torchtitan=[
            f / statistics.median(t["step_s"][opts.warmup:]) for f, t in zip(floors, titan_runs)])
    for v, side in [(v, side) for v in variants for side in ours_sides]:
        ours, titan = summary[f"{side}_{v}"], summary[f"torchtitan_{v}"]
        # Each round's ours against the torchtitan run of the same round: robust to drifting load.
        pairs = [statistics.median(o["step_s"][opts.warmup:]) / statistics.median(t["step_s"][opts.warmup:])
                 for o, t in zip(runs[f"{side}_{v}"], runs[f"torchtitan_{v}"])]
        # Keyed by the variant for "ours" (the MFSDP side, as the JSON files before --engines), else side_variant.
        ratios[v if side == "ours" else f"{side}_{v}"] = dict(
                         step_ours_over_torchtitan=ours["median_step_s"] / titan["median_step_s"],
                         per_round_step_ratios=pairs,
                         rss_ours_over_torchtitan=ours["peak_rss_mb"] / titan["peak_rss_mb"],
                         final_loss_rel_diff=(ours["final_loss"] - titan["final_loss"]) / titan["final_loss"],
                         final_loss_last3_rel_diff=(ours["final_loss_mean_last3"] - titan["final_loss_mean_last3"])
                         / titan["final_loss_mean_last3"])
    if len(variants) > 1:
        for side in ours_sides:
            ratios["best" if side == "ours" else f"{side}_best"] = best_settings_ratio(runs, summary, side, variants,
                                                                                       opts.warmup)
    result = dict(command=" ".join(["python", os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]), nproc=opts.nproc,
                  commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                        text=True).stdout.strip(), engines=engines, shape=opts.shape, shape_config=shape,
                  steps=opts.steps, warmup=opts.warmup, rounds=opts.rounds, init=opts.init,
                  optimizer_implementation=opts.optimizer_implementation,
                  tokens_per_step=tokens_per_step, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  load_average=os.getloadavg(), summary=summary, ratios=ratios, runs=runs)
    out = opts.out or os.path.join(RESULTS, f"torchtitan_peer_n{opts.nproc}_{opts.shape}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(ratios, indent=1))
    print(f"-> {out}; python benchmarks/torchtitan_peer.py --report")


def best_settings_ratio(runs: dict, summary: dict, side: str, variants: list, warmup: int) -> dict:
    """The issue's goal ratio: each trainer at its best variant (eager or compiled), ours over
    torchtitan's; pooled (the faster variant's pooled median on each side) and per round (each
    side's faster variant in that round)."""
    def fastest(name):
        return min(variants, key=lambda v: summary[f"{name}_{v}"]["median_step_s"])

    def fastest_in_round(name, r):
        return min(statistics.median(runs[f"{name}_{v}"][r]["step_s"][warmup:]) for v in variants)

    ours_v, titan_v = fastest(side), fastest("torchtitan")
    per_round = [fastest_in_round(side, r) / fastest_in_round("torchtitan", r)
                 for r in range(len(runs[f"torchtitan_{variants[0]}"]))]
    return dict(step_ours_over_torchtitan=summary[f"{side}_{ours_v}"]["median_step_s"]
                / summary[f"torchtitan_{titan_v}"]["median_step_s"],
                per_round_step_ratios=per_round, ours_variant=ours_v, torchtitan_variant=titan_v)


def best_text(data: dict, key: str = "best") -> str:
    """``ratios[key]`` (``best``, or ``<side>_best`` for another of our engines) in words."""
    best = data["ratios"][key]
    side = "ours" if key == "best" else key[:-len("_best")]
    return (f"each trainer at its faster variant ({side} {best['ours_variant']}, torchtitan "
            f"{best['torchtitan_variant']}): step ratio **{best['step_ours_over_torchtitan']:.2f}**; per round, each "
            "side's faster variant of that round: " + ", ".join(f"{x:.2f}" for x in best["per_round_step_ratios"]))


TABLE_HEAD = ["| ranks | shape | steps (warm-up) x rounds | initial weights | our AdamW | variant | trainer | "
              "median step (s) | tokens/s | peak RSS per rank (MB) | final loss | launch, whole run (s) | "
              "step ratio (per-round ratios) | RSS ratio | final loss rel. diff |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def table_rows(data: dict) -> list:
    """The table's rows of one JSON file: torchtitan, then each of our sides, per variant."""
    lines = []
    variants = [k[len("torchtitan_"):] for k in data["summary"] if k.startswith("torchtitan_")]
    for variant in variants:
        for side in [side for side in LABELS if f"{side}_{variant}" in data["summary"]]:
            ratio = data["ratios"].get(variant if side == "ours" else f"{side}_{variant}")
            s = data["summary"][f"{side}_{variant}"]
            lo, hi = s["p25_p75_step_s"]
            extra = ["", "", ""]
            if side != "torchtitan":
                per_round = ", ".join(f"{x:.2f}" for x in ratio["per_round_step_ratios"])
                extra = [f"**{ratio['step_ours_over_torchtitan']:.2f}** ({per_round})",
                         f"{ratio['rss_ours_over_torchtitan']:.2f}", f"{100 * ratio['final_loss_rel_diff']:+.2f}%"]
            walls = [run["wall_s"] for run in data["runs"][f"{side}_{variant}"]]
            launch = sum(walls) / len(walls)
            lines.append(f"| {data['nproc']} | {data['shape']} | {data['steps']} ({data['warmup']}) x "
                         f"{data['rounds']} | {data.get('init', 'own')} | "
                         f"{data.get('optimizer_implementation', 'foreach')} | {variant} | {LABELS[side]} | {s['median_step_s']:.3f} "
                         f"[{lo:.3f}-{hi:.3f}] | {s['tokens_per_s']:.0f} | {s['peak_rss_mb']:.0f} | "
                         f"{s['final_loss']:.4f} | {launch:.0f} | " + " | ".join(extra) + " |")
    return lines


def floor_text(data: dict) -> str:
    floor = data["ratios"]["floor"]
    return ("the step's matrix products and attention alone (`benchmarks/step_floor.py`, before each round): "
            + ", ".join(f"{x:.3f}" for x in floor["floor_s"]) + " s, i.e. "
            + ", ".join(f"{x:.2f}" for x in floor["per_round_floor_over_torchtitan"])
            + " of that round's torchtitan step")


def _command_line(data: dict) -> str:
    commit = f", commit {data['commit']}" if data.get("commit") else ""
    return f"{data['command']}   # {data['date']}{commit}, load average {data['load_average'][0]:.1f}"


def report(results_dir: str) -> str:
    files = []
    for path in sorted(glob.glob(os.path.join(results_dir, "torchtitan_peer_n*_*.json"))):
        with open(path) as f:
            files.append((path, json.load(f)))
    # Runs with our trainer on both engines (--engines mfsdp,fsdp2) get a section of their own.
    both = [(p, d) for p, d in files if "fsdp2" in d.get("engines", ["mfsdp"])]
    files = [(p, d) for p, d in files if (p, d) not in both]
    lines = ["# torchtitan 0.3.0 (FSDP2) against `pretrain_gpt.py --use-mfsdp` (ZeRO-3), CPU, gloo", "",
             "Written by `python benchmarks/torchtitan_peer.py --report` from `torchtitan_peer_n*_*.json`; "
             "the method is in the docstring of `benchmarks/torchtitan_peer.py`. A step's time is the "
             "median over all measured steps of all rounds (p25-p75 in brackets); ratios are ours / torchtitan. "
             "Final loss: the global loss of the last step (both sides see the same sequences at every step).", ""]
    lines += TABLE_HEAD
    commands, notes = [], []
    for path, data in files:
        commands.append(_command_line(data))
        if data.get("note"):  # a remark added to the JSON by hand, e.g. what differed in that run
            notes.append(f"* {os.path.basename(path)}: {data['note']}")
        if "floor" in data["ratios"]:
            notes.append(f"* {os.path.basename(path)}: {floor_text(data)}")
        if "best" in data["ratios"]:
            notes.append(f"* {os.path.basename(path)}: {best_text(data)}")
        lines += table_rows(data)
    lines += ["", "Read with care: these runs shared a 2-core box with other jobs (the load average of each "
              "run is with its command below), so absolute times are several times an idle box's; the ratio "
              "of one interleaved run is the figure to quote. Both trainers see the same sequences at every "
              "step. With initial weights 'own' they start from each trainer's own init (torchtitan "
              "draws its embeddings with std 1.0, Megatron with 0.02, so torchtitan's first loss is ~8.1 "
              "against ~7.7), and the final-loss difference is the two recipes' as much as the trainers'; "
              "with 'torchtitan' (`--init torchtitan`) both start from torchtitan's initial weights, and the "
              "losses differ only by the trainers' arithmetic. Launch: the whole `torch.distributed.run` launch, start-up "
              "and compilation included (the compiled variants compile in their first steps, which the "
              "step times leave out). torchtitan's `--compile.enable` works on CPU; inductor warns that it "
              "does not generate code for complex operators, so torchtitan's complex-number RoPE stays "
              "eager inside its compiled blocks.", "", "Loss curves (global loss per step, last round):", ""]
    for path, data in files:
        for name, s in data["summary"].items():
            lines.append(f"* {data['nproc']} ranks, {data['shape']}, {name}: "
                         + " ".join(f"{x:.3f}" for x in s["losses"]))
    lines += ["", "Commands:", "", "```bash"] + commands + ["```", ""]
    if notes:
        lines += ["Notes:", ""] + notes + [""]
    for path, data in both:
        lines += [f"## The same trainer on both engines, `--use-mfsdp` and `--use-torch-fsdp2` ({data['date']})", "",
                  f"From `{os.path.basename(path)}`. One torchtitan run, then ours on MFSDP (ZeRO-3), then ours on "
                  "PyTorch's FSDP2 (`--use-torch-fsdp2`, the same trainer, model, tokens and recipe), in each "
                  "round; ratios are each of ours / torchtitan (per-round: against that round's torchtitan run). "
                  "Both of ours start from the same initial weights, hence the same losses.", ""]
        lines += TABLE_HEAD + table_rows(data) + [""]
        lines += ["Loss curves (last round): "] + [""] + [
            f"* {name}: " + " ".join(f"{x:.3f}" for x in s["losses"]) for name, s in data["summary"].items()]
        lines += ["", "```bash", _command_line(data), "```", ""]
        if data.get("note"):
            lines += [f"Note: {data['note']}", ""]
        if "floor" in data["ratios"]:
            lines += [f"Floor: {floor_text(data)}.", ""]
        lines += [f"Best settings: {best_text(data, key)}.\n" for key in data["ratios"]
                  if key == "best" or key.endswith("_best")]
    text = "\n".join(lines)
    with open(os.path.join(results_dir, "torchtitan_peer.md"), "w") as f:
        f.write(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--shape", choices=SHAPES, default="small")
    parser.add_argument("--steps", type=int, default=10, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the timing")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (torchtitan, ours) per variant")
    parser.add_argument("--variants", default="eager", help="comma list of eager, compiled")
    parser.add_argument("--engines", default="mfsdp", help="our trainer's engines, comma list of mfsdp "
                        "(--use-mfsdp, ZeRO-3), fsdp2 (--use-torch-fsdp2); each runs after torchtitan in every round")
    parser.add_argument("--init", choices=("own", "torchtitan"), default="own",
                        help="own: each trainer its own initialization recipe (torchtitan's Llama-3, Megatron's "
                             "normal 0.02); torchtitan: both start from torchtitan's initial weights")
    parser.add_argument("--optimizer-implementation", choices=("foreach", "fused"), default="fused",
                        help="our AdamW's implementation (torchtitan's is fused; foreach: the results before "
                             "2026-12-06 19:00 UTC)")
    parser.add_argument("--floor", action="store_true",
                        help="each round also times the step's matrix products and attention alone "
                             "(benchmarks/step_floor.py), beside that round's torchtitan step")
    parser.add_argument("--work", default="/tmp/torchtitan_peer", help="logs and per-run outputs")
    parser.add_argument("--out", default=None, help="JSON (default results/torchtitan_peer_n<N>_<shape>.json)")
    parser.add_argument("--setup-venv", action="store_true", help="only create .venv-titan")
    parser.add_argument("--report", nargs="?", const=RESULTS, metavar="DIR", help="render DIR's JSON files")
    opts = parser.parse_args()
    if opts.report:
        print(report(opts.report))
        return
    if opts.warmup >= opts.steps:
        parser.error(f"--warmup ({opts.warmup}) must be below --steps ({opts.steps}).")
    main_run(opts)


if __name__ == "__main__":
    main()
