#!/usr/bin/env python
"""The largest GPT the trainer (``pretrain_gpt.py``) trains on this box, with a layout of choice.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/largest_trainer_model.py --layers 39 40 41 \
        --pipeline 4 --out benchmarks/results/largest_trainer_model.json

``benchmarks/largest_model.py`` searches the engines' largest model in a bare loop (one
data-parallel mesh, no pipeline); this runs the trainer itself, so any layout its flags
give counts: pipeline parallelism puts the embedding on the first stage and the output
layer on the last (``--untie-embeddings-and-output-weights``), and uneven stages
(``--decoder-first/last-pipeline-num-layers``) give the edge stages fewer layers. Each
``--layers`` value is one ``torch.distributed.run`` launch of 2 iterations (fp32, Adam,
full recompute, mock data), watched as largest_model.py watches its trials: the summed RSS
and the box's MemAvailable every 50 ms, the launch killed before the box runs out.

Reported per launch: parameters (the trainer's "> model:" line), each rank's peak RSS
(VmHWM, read until the rank exits), their sum against ``--memory-budget-gib``, the second
iteration's time and the two losses. The environment (e.g. ``MALLOC_MMAP_THRESHOLD_``,
glibc's: allocations past it are mapped and returned on free, not kept in the heap) is
recorded with the result.

``--trainer torchtitan`` runs the same search on torchtitan 0.3.0 (``.venv-titan``, through
``benchmarks/torchtitan_cpu_launcher.py``, as the peer benchmark): its Llama-3 of the same
hidden size, heads and vocabulary (SwiGLU 4096 at hidden 1536: the same parameters per layer
as the trainer's GELU 4 x 1536), FSDP2 over all ranks (its launcher has no pipeline), full
activation checkpointing, fp32 AdamW, random tokens; ``--pipeline`` does not apply.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/largest_trainer_model.py --trainer torchtitan \
        --layers 28 30 --out benchmarks/results/largest_torchtitan_model.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import psutil

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
GIB = 2**30


def edge_layers(layers: int, pipeline: int) -> tuple:
    """(first, last) stage layers, the middle stages each holding more than either edge
    (the edges also hold the embedding or the output layer); (None, None) when the stages
    split evenly or nothing uneven fits."""
    if pipeline < 3:
        return None, None
    for first in range(layers // pipeline, 0, -1):
        for last in (first, first + 1):
            rest = layers - first - last
            if rest % (pipeline - 2) == 0 and rest // (pipeline - 2) > last:
                return first, last
    return None, None


def command(opts, layers: int, log_dir: str) -> list:
    flags = ["--num-layers", str(layers), "--hidden-size", str(opts.hidden),
             "--num-attention-heads", str(opts.hidden // 128), "--seq-length", str(opts.seq_length),
             "--max-position-embeddings", str(opts.seq_length), "--micro-batch-size", "1",
             "--global-batch-size", str(opts.nproc), "--train-iters", "2", "--lr", "1e-4", "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", str(opts.vocab),
             "--pipeline-model-parallel-size", str(opts.pipeline), "--untie-embeddings-and-output-weights",
             "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
             "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--num-workers", "0", "--log-dir", log_dir, *opts.extra]
    first, last = edge_layers(layers, opts.pipeline)
    if first is not None:
        flags += ["--decoder-first-pipeline-num-layers", str(first), "--decoder-last-pipeline-num-layers", str(last)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(opts.nproc),
            "pretrain_gpt.py", *flags]


def titan_command(opts, layers: int, tmp: str) -> list:
    """torchtitan's launch of 2 steps at this size, on random tokens written to ``tmp``."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import numpy as np
    import torchtitan_peer as peer  # its venv and tokenizer; imported here: it loads the trainer

    tokens = os.path.join(tmp, "tokens.npy")
    rows = np.random.default_rng(0).integers(0, peer.VOCAB, (2 * opts.nproc, opts.seq_length + 1))
    np.save(tokens, rows.astype(np.int32))
    tokenizer, _ = peer.shakespeare()
    return [peer.setup_venv(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(opts.nproc),
            os.path.join(REPO, "benchmarks", "torchtitan_cpu_launcher.py"), "--tokens", tokens, "--tokenizer", tokenizer,
            "--dim", str(opts.hidden), "--layers", str(layers), "--heads", str(opts.hidden // 128),
            "--vocab", str(opts.vocab), "--seq-len", str(opts.seq_length), "--local-batch-size", "1",
            "--steps", "2", "--lr", "1e-4", "--full-recompute", "--dump-folder", os.path.join(tmp, "dump"),
            "--out", os.path.join(tmp, "titan.json")]


def _vmhwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def launch(opts, layers: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="largest_trainer_") as tmp:
        titan = opts.trainer == "torchtitan"
        cmd = titan_command(opts, layers, tmp) if titan else command(opts, layers, os.path.join(tmp, "logs"))
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        if titan:  # its own venv: none of the project's paths
            env = {k: v for k, v in env.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        out_path = os.path.join(tmp, "out.log")
        with open(out_path, "w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # own group: the guard kills it whole
        start, peaks, killed = time.perf_counter(), {}, None
        while proc.poll() is None:
            try:
                ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for p in ranks:
                try:
                    peaks[p.pid] = _vmhwm(p.pid)
                except (OSError, StopIteration):
                    pass  # exited between the listing and the read: its last reading stands
            if psutil.virtual_memory().available < opts.reserve_gib * GIB:
                killed = f"MemAvailable under {opts.reserve_gib} GiB"
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.05)
        output = open(out_path).read()
        result = {"layers": layers, "command": cmd[3:], "wall_s": time.perf_counter() - start,
                  "returncode": proc.returncode, "killed": killed}
        rank_peaks = sorted(peaks.values(), reverse=True)[:opts.nproc]  # the ranks, not the launcher
        if titan:
            done = os.path.exists(os.path.join(tmp, "titan.json"))
            report = json.load(open(os.path.join(tmp, "titan.json"))) if done else {}
            params, iterations = report.get("params"), list(zip(report.get("step_s", []), report.get("losses", [])))
        else:
            model = re.search(r"> model: ([\d,]+) parameters", output)
            params = int(model.group(1).replace(",", "")) if model else None
            iterations = [(float(ms) / 1000, float(loss)) for ms, loss in
                          re.findall(r"elapsed time per iteration \(ms\): ([\d.]+).*?lm loss: (\S+) \|", output)]
        result.update(params=params, peak_rss_per_rank=rank_peaks, summed_peak_rss=sum(rank_peaks),
                      iteration_s=[t for t, _ in iterations], losses=[loss for _, loss in iterations])
        result["fits"] = (proc.returncode == 0 and killed is None and len(iterations) == 2
                          and result["summed_peak_rss"] <= opts.memory_budget_gib * GIB)
        if proc.returncode != 0:
            result["output_tail"] = output[-2000:]
        return result


def table(opts, runs) -> str:
    env = {k: os.environ[k] for k in sorted(os.environ) if k.startswith("MALLOC_")}
    who = ("torchtitan 0.3.0 (FSDP2, no pipeline)" if opts.trainer == "torchtitan"
           else f"`pretrain_gpt.py`, pipeline parallel {opts.pipeline}")
    lines = [f"Largest GPT {who} trains 2 iterations: {opts.nproc} CPU ranks, budget {opts.memory_budget_gib} GiB "
             f"(summed per-rank peak RSS), hidden {opts.hidden}, "
             f"vocab {opts.vocab} (untied), seq {opts.seq_length}, fp32 Adam, full recompute; environment {env or '{}'}",
             "",
             "| layers | params | per-rank peak RSS (GiB) | summed (GiB) | fits | time/iteration (s) | losses |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        per_rank = " / ".join(f"{b / GIB:.2f}" for b in r["peak_rss_per_rank"])
        params = f"{r['params'] / 1e6:.1f}M" if r["params"] else "-"
        it = f"{r['iteration_s'][-1]:.1f}" if r["iteration_s"] else "-"
        lines.append(f"| {r['layers']} | {params} | {per_rank} | {r['summed_peak_rss'] / GIB:.2f} | "
                     f"{'yes' if r['fits'] else 'no'} | {it} | {' '.join(f'{x:.5f}' for x in r['losses'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", required=True)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--trainer", choices=["ours", "torchtitan"], default="ours")
    p.add_argument("--pipeline", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--memory-budget-gib", type=float, default=21.0)
    p.add_argument("--reserve-gib", type=float, default=0.8, help="kill a launch when MemAvailable falls below this")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more trainer flags (last on the line)")
    p.add_argument("--out", default=None, help="JSON of every launch; the table goes next to it as .md")
    opts = p.parse_args(argv)
    runs = []
    for layers in opts.layers:
        runs.append(launch(opts, layers))
        r = runs[-1]
        print(f"layers {layers}: {'fits' if r['fits'] else 'does not fit'}, "
              f"summed peak {r['summed_peak_rss'] / GIB:.2f} GiB", flush=True)
    text = table(opts, runs)
    print(text)
    if opts.out:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
        env = {k: os.environ[k] for k in sorted(os.environ) if k.startswith("MALLOC_")}
        with open(opts.out, "w") as f:
            json.dump({"options": vars(opts), "environment": env, "date": stamp, "commit": commit,
                       "load_average": os.getloadavg(), "runs": runs}, f, indent=1)
        prefix = " ".join(f"{k}={v}" for k, v in env.items())
        with open(os.path.splitext(opts.out)[0] + ".md", "w") as f:
            f.write(text + f"\n\n```bash\n{prefix + ' ' if prefix else ''}python benchmarks/largest_trainer_model.py "
                    f"{' '.join(argv if argv is not None else sys.argv[1:])}   # {stamp}, commit {commit}\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
