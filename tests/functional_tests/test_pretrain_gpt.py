"""End-to-end runs of pretrain_gpt.py on 2 CPU ranks (gloo).

* MFSDP (ZeRO-3, and ZeRO-1 on a 2-D HSDP-style mesh is left to the engine's tests) gives
  the same per-iteration losses and grad norms as DDP, in fp32, to a tight tolerance;
* the metric sinks are written: metrics.jsonl, a TensorBoard event file, and an offline
  W&B run directory;
* `srun python pretrain_gpt.py` works without torchrun (SLURM variables only);
* a bad flag combination is rejected before anything starts.
"""

import glob
import json
import os

import pytest

import forked_launch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
TIMEOUT = 300

# Tiny model, mock data: 2 microbatches per rank per step (exercises microbatch / no_sync),
# clipping active, warmup + cosine decay, no dropout (so both runs are deterministic).
MODEL_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--clip-grad", "0.3", "--weight-decay", "0.1",
    "--train-iters", "10", "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "2",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--num-workers", "0", "--seed", "7",
]


def _env(extra=None):
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    for key in [k for k in env if k.startswith(("SLURM_", "TORCHELASTIC"))]:
        env.pop(key)
    env.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1",
                "CUDA_VISIBLE_DEVICES": ""})
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def _check(proc):
    assert proc.returncode == 0, f"exit code {proc.returncode}\n--- output tail ---\n{proc.stdout[-6000:]}"
    # A rank torn down uncleanly (e.g. rank 0's store gone first) can still exit 0 under torchrun.
    assert "terminate called" not in proc.stdout, proc.stdout[-3000:]
    return proc


def launch_ranks(args, nproc=2, *, script="pretrain_gpt.py", env=None, rank_envs=None, cwd=REPO, merge_stderr=True,
                 timeout=TIMEOUT):
    """``script`` (pretrain_gpt.py, or a tool) at ``nproc`` ranks as torchrun would launch it
    (None: one plain process; ``rank_envs``: one process per entry, srun-style), forked from a
    process that imported the trainer once (forked_launch.py says why and what differs),
    whatever its exit code. Tests of the launch itself run torchrun."""
    return forked_launch.server().launch(script, args, nproc=nproc, env=_env(env), rank_envs=rank_envs, cwd=cwd,
                                         timeout=timeout, merge_stderr=merge_stderr)


def run_ranks(args, nproc=2, **kwargs):
    """:func:`launch_ranks`, which must succeed."""
    return _check(launch_ranks(args, nproc, **kwargs))


SAVE = "{save}"  # in run_layouts' flags: replaced by the checkpoints' directory


def run_layouts(base_args, runs, tmp_path_factory):
    """``{name: (ranks, flags)}`` -> ``{name: (train, valid, stdout)}``, each run launched
    with ``base_args + flags``, in order (later runs may load earlier ones' checkpoints
    under ``SAVE``); ``"checkpoints"`` is that directory."""
    out = {}
    save = str(tmp_path_factory.mktemp("checkpoints"))
    for name, (nproc, flags) in runs.items():
        log_dir = tmp_path_factory.mktemp(name) / "logs"
        flags = [f.replace(SAVE, save) for f in flags]
        proc = run_ranks(base_args + flags + ["--log-dir", str(log_dir)], nproc=nproc)
        out[name] = read_metrics(str(log_dir)) + (proc.stdout,)
    out["checkpoints"] = save
    return out


def assert_same_curve(runs, name, reference, iters, first=1):
    """Run ``name`` of ``run_layouts`` gives ``reference``'s losses (rel 1e-5), grad norms
    (rel 1e-4) and consumed samples (8 per iteration) from iteration ``first`` to ``iters``,
    and its last validation loss."""
    train, valid, _ = runs[name]
    ref_train, ref_valid, _ = runs[reference]
    assert sorted(train) == list(range(first, iters + 1)), name
    for it in range(first, iters + 1):
        assert train[it]["lm_loss"] == pytest.approx(ref_train[it]["lm_loss"], rel=1e-5), (name, it)
        assert train[it]["grad_norm"] == pytest.approx(ref_train[it]["grad_norm"], rel=1e-4), (name, it)
        assert train[it]["consumed_samples"] == 8 * it
    assert valid[iters]["lm_loss"] == pytest.approx(ref_valid[iters]["lm_loss"], rel=1e-5), name


def read_metrics(log_dir):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = {r["iteration"]: r for r in records if r["kind"] == "train"}
    valid = {r["iteration"]: r for r in records if r["kind"] == "validation"}
    return train, valid


def test_mfsdp_losses_equal_ddp_losses(ddp_run, mfsdp_run):
    ddp_train, ddp_valid = read_metrics(str(ddp_run[0] / "logs"))
    fsdp_train, fsdp_valid = read_metrics(str(mfsdp_run[0] / "logs"))
    assert sorted(ddp_train) == sorted(fsdp_train) == list(range(1, 11))
    for it in range(1, 11):
        a, b = ddp_train[it], fsdp_train[it]
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5, abs=1e-6), it
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-6), it
        assert b["learning_rate"] == pytest.approx(a["learning_rate"], rel=1e-12), it
        assert b["consumed_samples"] == a["consumed_samples"] == 8 * it
    # Training moved the model (equal losses of an untrained model would prove little).
    assert ddp_train[10]["lm_loss"] != ddp_train[1]["lm_loss"]
    assert sorted(ddp_valid) == sorted(fsdp_valid) == [5, 10]
    for it in (5, 10):
        assert fsdp_valid[it]["lm_loss"] == pytest.approx(ddp_valid[it]["lm_loss"], rel=1e-5)


def test_log_lines_look_like_megatron(mfsdp_run):
    out = mfsdp_run[1]
    lines = [l for l in out.splitlines() if " iteration " in l and "consumed samples" in l]
    assert len(lines) == 10
    assert "iteration       10/      10 | consumed samples:           80 |" in lines[-1]
    for field in ("elapsed time per iteration (ms):", "throughput per GPU (TFLOP/s/GPU):", "tokens per second:",
                  "learning rate:", "global batch size:     8 |", "lm loss:", "grad norm:",
                  "number of skipped iterations:   0 |", "number of nan iterations:   0 |", "mem (max RSS MB):"):
        assert field in lines[-1], field
    assert " validation loss at iteration 5 | lm loss value: " in out
    assert "MFSDP optim_grads_params" in out


def test_tensorboard_and_wandb_offline_files_are_written(mfsdp_run):
    out = mfsdp_run[0]
    events = glob.glob(str(out / "tb" / "events.out.tfevents.*"))
    assert len(events) == 1 and os.path.getsize(events[0]) > 0
    runs = glob.glob(str(out / "wandb" / "wandb" / "offline-run-*"))
    assert len(runs) == 1, os.listdir(out / "wandb")
    assert glob.glob(os.path.join(runs[0], "run-*.wandb"))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(events[0])
    acc.Reload()
    losses = acc.Scalars("lm-loss")
    assert [e.step for e in losses] == list(range(1, 11))
    assert "lm-loss validation" in acc.Tags()["scalars"]


def test_srun_style_launch_without_torchrun(tmp_path):
    """What `srun --ntasks 2 python pretrain_gpt.py ...` gives each task: SLURM variables only."""
    port = str(forked_launch.free_port())
    args = MODEL_ARGS[:]
    args[args.index("--train-iters") + 1] = "3"
    out = run_ranks(args + ["--use-mfsdp"], nproc=None, rank_envs=[
        {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
         "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "4242", "MASTER_PORT": port} for rank in range(2)]).stdout
    assert "world size 2" in out
    assert "iteration        3/       3" in out


def test_exit_duration_saves_and_stops_every_rank_at_the_same_iteration(tmp_path):
    """--exit-duration-in-mins as Megatron: checked after every iteration, the decision is
    the maximum over ranks, and the run saves and exits 0 (a 0.0001-minute budget is spent
    by the end of iteration 1)."""
    port, save = str(forked_launch.free_port()), tmp_path / "ckpt"
    proc = launch_ranks(MODEL_ARGS + ["--use-mfsdp", "--exit-duration-in-mins", "0.0001", "--save", str(save)],
                        nproc=None, rank_envs=[{"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
                                                "SLURM_LOCALID": str(rank), "SLURM_JOB_NODELIST": "localhost",
                                                "MASTER_PORT": port} for rank in range(2)])
    assert proc.returncodes == [0, 0], proc.stdout[-6000:]
    assert "(--exit-duration-in-mins 0.0001) at iteration 1" in proc.stdout, proc.stdout[-3000:]
    assert "iteration        2/" not in proc.stdout
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_inconsistent_flags_fail_at_parse_time():
    args = MODEL_ARGS[:]
    args[args.index("--global-batch-size") + 1] = "6"
    proc = launch_ranks(args + ["--use-mfsdp"], nproc=None, env={"RANK": "0", "WORLD_SIZE": "2"}, timeout=120)
    assert proc.returncode == 2
    assert "error: --global-batch-size (6) must be divisible by --micro-batch-size (2) x data-parallel size (2)" in proc.stdout
    assert "Traceback" not in proc.stdout
