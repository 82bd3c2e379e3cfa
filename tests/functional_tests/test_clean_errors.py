"""A user error prints one line (``pretrain_gpt.py: error: ...``) from rank 0 and exits
non-zero, without a traceback; MEGATRON_DEBUG_TRACEBACK=1 brings the traceback back."""

import os
import subprocess
import sys

import pytest
from test_pretrain_gpt import launch_ranks

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
        "--lr 1e-3 --train-iters 2 --eval-iters 0 --num-workers 0").split()
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]


def _env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", WANDB_MODE="offline")
    env.update(extra or {})
    return env


def run(argv, extra_env=None):
    """``python pretrain_gpt.py argv`` (forked from the launch server: the cases are many and
    each fails in a second; the tensorboard case, with its own PYTHONPATH, runs its own)."""
    return launch_ranks(argv, nproc=None, env=extra_env, merge_stderr=False, timeout=120)


def single_error_line(proc):
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    return errors[0]


def _corrupt_checkpoint(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7\n")
    return str(tmp_path)


CASES = {
    "data path": (lambda t: NULL + ["--data-path", str(t / "missing")], 2, "--data-path prefix"),
    "tokenizer": (lambda t: ["--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                             str(t / "none")], 2, "--tokenizer-model"),
    "vocab file": (lambda t: ["--mock-data", "--vocab-file", str(t / "v.json"), "--merge-file", str(t / "m.txt")],
                   2, "--vocab-file"),
    "load is a file": (lambda t: NULL + ["--mock-data", "--load", str(t / "file")], 2,
                       "is a file; pass the checkpoint directory"),
    "checkpoint": (lambda t: NULL + ["--mock-data", "--load", _corrupt_checkpoint(t)], 1, "--load"),
    "save path": (lambda t: NULL + ["--mock-data", "--save", str(t / "file" / "ckpt")], 2, "--save"),
    "unknown flag": (lambda t: NULL + ["--mock-data", "--lr-decay-iter", "5"], 2, "did you mean --lr-decay-iters"),
    "rejected flag": (lambda t: NULL + ["--mock-data", "--tp-comm-overlap"], 2, "--tp-comm-overlap is not supported"),
    "parallel size": (lambda t: NULL + ["--mock-data", "--pipeline-model-parallel-size", "2"], 2,
                      "--pipeline-model-parallel-size (2) must divide the world size (1)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_user_error_is_one_line(case, tmp_path):
    (tmp_path / "file").write_text("")
    make_argv, code, needle = CASES[case]
    proc = run(BASE + make_argv(tmp_path))
    assert proc.returncode == code, proc.stderr[-3000:]
    line = single_error_line(proc)
    assert line.startswith("pretrain_gpt.py: error: ") and needle in line, line


def test_missing_tensorboard_is_a_parse_time_error(tmp_path):
    shadow = tmp_path / "shadow" / "tensorboard"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named tensorboard')\n")
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *BASE, *NULL, "--mock-data", "--tensorboard-dir",
                           str(tmp_path / "tb")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=_env({"PYTHONPATH": f"{tmp_path / 'shadow'}{os.pathsep}{REPO}"}), timeout=120)
    assert proc.returncode == 2
    assert "install the 'logging' extra with `MEGATRON_EXTRAS=logging source scripts/setup_env.sh`" in \
        single_error_line(proc)
    assert not (tmp_path / "tb").exists()


def test_debug_env_var_restores_the_traceback(tmp_path):
    proc = run(BASE + NULL + ["--mock-data", "--load", _corrupt_checkpoint(tmp_path)], {"MEGATRON_DEBUG_TRACEBACK": "1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr


def test_two_ranks_print_one_line(tmp_path):
    """srun-style launch (SLURM variables, no torchrun): one line in all, from rank 0."""
    port = str(29000 + os.getpid() % 1000)
    proc = launch_ranks(BASE + NULL + ["--mock-data", "--load", _corrupt_checkpoint(tmp_path)], nproc=None,
                        rank_envs=[{"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                                    "SLURM_JOB_NODELIST": "localhost", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
                                   for rank in range(2)], merge_stderr=False, timeout=120)
    assert proc.returncodes == [1, 1]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]  # both ranks' stderr
    assert len(errors) == 1 and "--load" in errors[0], errors
    assert "Traceback" not in proc.stderr


def test_torchrun_prints_the_line_when_rank_0_is_slowest(tmp_path):
    """Rank 1 reaches the error seconds before rank 0 (held back at start-up by a
    sitecustomize): it must not exit first, or torchrun kills rank 0 before it prints."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(4)\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "pretrain_gpt.py", *BASE, *NULL, "--mock-data", "--lr-decay-iter", "5"], cwd=REPO,
                          env=_env({"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    assert lines == ["pretrain_gpt.py: error: unrecognized arguments: --lr-decay-iter 5 "
                     "(did you mean --lr-decay-iters?)"], proc.stderr[-3000:]
