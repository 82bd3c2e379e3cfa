"""What the implemented Megatron-LM flags do to a run (one process, in-process pretrain):
fp16 loss scaling skips overflowing steps, --calculate-per-token-loss changes the
normalization, sample-based schedules, --exit-interval, --exit-signal, --manual-gc,
--deterministic-mode, --timing-log-level, --use-checkpoint-opt_param-scheduler,
--tensorboard-log-interval."""

import gc
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron.training import pretrain

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
        "--lr 1e-2 --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0 "
        "--mock-data --tokenizer-type NullTokenizer --vocab-size 64 --num-workers 0 --seed 3").split()


def run(extra, forward_step=None, datasets=None):
    if "--train-" not in extra:
        extra += " --train-iters 4"
    return pretrain(datasets or pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                    forward_step or pretrain_gpt.forward_step, argv=BASE + extra.split())


def test_fp16_dynamic_loss_scale_skips_overflowing_steps(capsys):
    # 2**40 overflows fp16 in backward: the step is skipped and the scale halves (hysteresis 1)
    # until the gradients are finite again.
    metrics = run("--fp16 --initial-loss-scale 1099511627776 --hysteresis 1 --train-iters 30 --log-interval 30")
    out = capsys.readouterr().out
    line = [line for line in out.splitlines() if "iteration       30/" in line][0]
    skipped = int(line.split("number of skipped iterations:")[1].split("|")[0])
    assert 10 <= skipped < 30
    assert metrics["skipped_iterations"] == skipped
    assert metrics["loss_scale"] == 2.0 ** (40 - skipped)
    assert f"loss scale: {2.0 ** (40 - skipped):.1f}" in line
    # A static scale that does not overflow skips nothing and stays put.
    metrics = run("--fp16 --loss-scale 128")
    assert metrics["skipped_iterations"] == 0 and metrics["loss_scale"] == 128.0


class _UnevenMasks(torch.utils.data.Dataset):
    """Mock samples whose loss masks keep a different number of tokens per sample."""

    def __init__(self, n, seq, vocab):
        from megatron.core.datasets import MockGPTDataset

        self.mock = MockGPTDataset(n, seq, vocab, 0)

    def __len__(self):
        return len(self.mock)

    def __getitem__(self, i):
        sample = dict(self.mock[i])
        mask = np.zeros_like(sample["loss_mask"])
        mask[: 1 + (i % 4) * 5] = 1  # 1, 6, 11 or 16 loss tokens
        sample["loss_mask"] = mask
        return sample


def _uneven(args, tokenizer, num_samples):
    return _UnevenMasks(num_samples[0], args.seq_length, tokenizer.vocab_size), None, None


def test_per_token_loss_normalizes_over_the_global_batch():
    # Default (Megatron's): the mean of each microbatch's mean; per-token: one mean over all
    # loss tokens of the global batch. With uneven masks the updates differ.
    extra = "--global-batch-size 4 --micro-batch-size 1 --train-iters 3 --clip-grad 0"
    default = run(extra, datasets=_uneven)
    per_token = run(extra + " --calculate-per-token-loss", datasets=_uneven)
    again = run(extra, datasets=_uneven)
    assert default["lm_loss"] == again["lm_loss"]
    assert abs(default["lm_loss"] - per_token["lm_loss"]) > 1e-4


def test_sample_based_schedule():
    metrics = run("--train-samples 12 --lr-warmup-samples 4 --lr-decay-samples 10")
    # 12 samples of 2 = 6 iterations; at 12 consumed samples the linear decay (ending at
    # sample 10) has reached min-lr 0.
    assert metrics["consumed_samples"] == 12
    assert metrics["learning_rate"] == 0.0


def test_exit_interval_saves_and_exits(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        run(f"--train-iters 10 --exit-interval 2 --save {tmp_path}")
    assert exit_info.value.code == 0
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_manual_gc_and_deterministic_mode_hold_during_training():
    seen = []

    def forward_step(data_iterator, model):
        seen.append((gc.isenabled(), torch.are_deterministic_algorithms_enabled()))
        return pretrain_gpt.forward_step(data_iterator, model)

    collections = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            collections.append(1)

    gc.callbacks.append(count)
    try:
        run("--manual-gc --manual-gc-interval 2 --deterministic-mode", forward_step=forward_step)
    finally:
        gc.callbacks.remove(count)
        torch.use_deterministic_algorithms(False)
    assert seen and all(not enabled and deterministic for enabled, deterministic in seen)
    assert len(collections) >= 1 + 4 // 2  # at the start, then every 2 iterations
    assert gc.isenabled()


def test_timing_log_level_selects_the_timers(capsys):
    run("--timing-log-level 2 --train-iters 1")
    out = capsys.readouterr().out
    assert "(min, max) time across ranks (ms):" in out and "forward-compute" in out and "optimizer-inner-step" in out
    run("--timing-log-level 1 --timing-log-option max --train-iters 1")
    out = capsys.readouterr().out
    assert "max time across ranks (ms):" in out and "optimizer" in out and "forward-compute" not in out
    run("--train-iters 1")
    assert "time across ranks" not in capsys.readouterr().out


def test_use_checkpoint_opt_param_scheduler(tmp_path):
    run(f"--train-iters 2 --save {tmp_path} --lr 1e-2 --lr-decay-style constant")
    resumed = run(f"--train-iters 3 --load {tmp_path} --lr 5e-3 --lr-decay-style constant")
    assert resumed["learning_rate"] == 5e-3  # the command line's schedule (the default)
    kept = run(f"--train-iters 3 --load {tmp_path} --lr 5e-3 --lr-decay-style constant "
               "--use-checkpoint-opt_param-scheduler")
    assert kept["learning_rate"] == 1e-2  # the checkpoint's


def test_exit_signal_names_the_signal(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    for key in [k for k in env if k.startswith("SLURM_") or k in ("RANK", "WORLD_SIZE")]:
        env.pop(key)
    proc = subprocess.Popen([sys.executable, "pretrain_gpt.py", *BASE, "--train-iters", "100000",
                             "--exit-signal-handler", "--exit-signal", "SIGUSR1", "--save", str(tmp_path)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "iteration        2/" in line:
                break
        proc.send_signal(signal.SIGUSR1)
        out = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "exiting on signal after iteration" in out and "(SIGUSR1)" in out
    assert (tmp_path / "latest_checkpointed_iteration.txt").is_file()


def _tensorboard_scalars(tb_dir):
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))
    assert len(events) == 1, events
    acc = EventAccumulator(events[0])
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _jsonl_losses(path):
    import json

    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, open(path)) if r["kind"] == "train"}


def test_tensorboard_log_interval_writes_each_iterations_own_values(tmp_path):
    # Reference: --log-interval 1 puts every iteration's loss into metrics.jsonl.
    run(f"--train-iters 8 --tensorboard-dir {tmp_path}/ref")
    per_iteration = _jsonl_losses(tmp_path / "ref" / "metrics.jsonl")
    assert sorted(per_iteration) == list(range(1, 9))
    for tb_interval, steps in ((1, list(range(1, 9))), (2, [2, 4, 6, 8])):
        out = tmp_path / f"tb{tb_interval}"
        run(f"--train-iters 8 --log-interval 4 --tensorboard-log-interval {tb_interval} --tensorboard-dir {out}")
        scalars = _tensorboard_scalars(str(out))
        for tag in ("lm-loss", "learning-rate", "grad-norm", "global-batch-size"):
            assert sorted(scalars[tag]) == steps, (tag, scalars[tag])
        # That iteration's loss, not the mean over the log interval.
        for step in steps:
            assert scalars["lm-loss"][step] == pytest.approx(per_iteration[step], rel=1e-6)
        # The interval's numbers follow --log-interval, as do the console line and metrics.jsonl.
        assert sorted(scalars["tokens-per-second"]) == [4, 8]
        interval_mean = _jsonl_losses(out / "metrics.jsonl")
        assert sorted(interval_mean) == [4, 8]
        assert interval_mean[8] == pytest.approx(sum(per_iteration[i] for i in range(5, 9)) / 4, rel=1e-6)


def test_first_line_by_iteration_one_and_time_left_whatever_the_log_interval(capsys):
    run("--train-iters 3 --log-interval 100")
    lines = [line for line in capsys.readouterr().out.splitlines() if "/       3 |" in line]
    assert len(lines) == 2, lines
    first, last = lines
    assert "iteration        1/       3 | first iteration of this run (s): " in first
    assert "| lm loss: " in first and "| time left: " in first
    assert first.endswith("| next line at iteration 3 (--log-interval 100)")
    assert "iteration        3/       3 | consumed samples:" in last and last.endswith("| time left: 0s |")
    # At --log-interval 1 the first line is Megatron's own line, with the time left.
    run("--train-iters 2")
    lines = [line for line in capsys.readouterr().out.splitlines() if "/       2 |" in line]
    assert len(lines) == 2 and "first iteration of this run" not in lines[0]
    assert "iteration        1/       2 | consumed samples:" in lines[0] and "| time left: " in lines[0]
