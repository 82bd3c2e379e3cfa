"""Exit stress: run pretrain_gpt.py's short train-save-exit cycle many times and count the
runs that do not exit 0 (a rank aborting at interpreter exit, a hang, a traceback).

Each cycle is a fresh run that saves, then a run that resumes from that checkpoint and
saves again; layouts rotate over data parallel (MFSDP ZeRO-3, --async-save on some),
pipeline parallel 2 and, at 4 ranks, PP=2 x DP=2.

    nice python benchmarks/exit_stress.py --runs 50 --nproc 2 4 --out /tmp/exit_stress

Prints one line per run and a summary; exits 1 if any run failed. The logs of failed
runs are kept under --out.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --lr 1e-3 --lr-warmup-iters 1 --mock-data --tokenizer-type NullTokenizer "
         "--vocab-size 64 --log-interval 1 --eval-iters 0 --num-workers 0 --use-mfsdp").split()
# Per layout: the flags, given the number of ranks. Global batch = 4 microbatches per DP rank.
LAYOUTS = {
    "dp": lambda n: ["--global-batch-size", str(2 * n)],
    "dp-async": lambda n: ["--global-batch-size", str(2 * n), "--async-save"],
    "pp2": lambda n: ["--pipeline-model-parallel-size", "2", "--global-batch-size", str(4 * n)],
}
# A hang must not hang the stress test; a finished cycle takes well under this.
TIMEOUT_S = 300


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def command(nproc: int, layout: str, save: str, train_iters: int, load: bool):
    args = MODEL + LAYOUTS[layout](nproc) + ["--train-iters", str(train_iters), "--lr-decay-iters", "8",
                                             "--save", save, "--save-interval", "2"]
    if load:
        args += ["--load", save]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--max-restarts", "0", os.path.join(REPO, "pretrain_gpt.py"), *args]


def run_once(cmd, log_path: str) -> tuple:
    """(exit status, seconds, what went wrong or '')."""
    start = time.time()
    with open(log_path, "w") as out:
        # A session of its own: on a timeout the whole launch goes (torchrun and its ranks),
        # not torchrun alone, which would leave its ranks waiting for its store.
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    text = open(log_path, errors="replace").read()
    why = ""
    if rc != 0:
        for needle in ("terminate called", "Traceback", "Signal 6", "SIGABRT", "SIGSEGV"):
            if needle in text:
                why = needle
                break
        why = why or ("timeout" if rc == 124 else "unknown")
    elif "> total time" not in text:
        rc, why = 1, "exited 0 without finishing"
    return rc, time.time() - start, why


def cycles(nprocs, runs, layouts=tuple(LAYOUTS)):
    """``runs`` train-save-exit runs per rank count: fresh, then resumed, per layout."""
    layouts = itertools.cycle(layouts)
    for nproc in nprocs:
        done = 0
        while done < runs:
            layout = next(layouts)
            yield nproc, layout, False
            done += 1
            if done < runs:
                yield nproc, layout, True
                done += 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="runs per rank count (default 50)")
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--out", default=None, help="where logs of failed runs are kept (default: a temp dir)")
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="exit_stress_")
    os.makedirs(out, exist_ok=True)
    failures, total, start = [], 0, time.time()
    work = tempfile.mkdtemp(prefix="exit_stress_ckpt_")
    try:
        for index, (nproc, layout, resume) in enumerate(cycles(args.nproc, args.runs, args.layouts)):
            save = os.path.join(work, f"{nproc}-{layout}")
            if not resume:
                shutil.rmtree(save, ignore_errors=True)
            log = os.path.join(out, f"run{index:03d}-{nproc}-{layout}{'-resume' if resume else ''}.log")
            # The fresh run trains 3 iterations (saves at 2 and 3); the resumed one goes on to 5.
            rc, seconds, why = run_once(command(nproc, layout, save, 5 if resume else 3, resume), log)
            total += 1
            name = f"{nproc} ranks {layout}{' resume' if resume else ''}"
            print(f"run {index:3d} {name:22s} exit {rc:3d} {seconds:5.1f} s {why}", flush=True)
            if rc != 0:
                failures.append((index, name, rc, why, log))
            else:
                os.remove(log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"exit stress: {total} runs, {len(failures)} non-zero exits, {time.time() - start:.0f} s")
    for index, name, rc, why, log in failures:
        print(f"  run {index} ({name}): exit {rc} {why}; log {log}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
