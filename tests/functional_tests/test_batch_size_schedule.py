"""--rampup-batch-size START INCREMENT SAMPLES and --step-batch-size-schedule: each
iteration's global batch, the consumed samples and the learning rate follow Megatron's
formulas, and a run resumed mid-ramp continues them exactly (one process, in-process
pretrain)."""

import json

import pytest

from test_megatron_flag_behaviour import run

# --global-batch-size 8, ramp 2 -> 8 by 2 over 10 samples: (8 - 2) / 2 = 3 increments of
# 10 / 3 samples; batch = 2 + 2 * int(consumed / (10 / 3)) while consumed <= 10, then 8.
# consumed 0, 2, 4, 8, 14, 22, 30 -> batches 2, 2, 4, 6, 8, 8, 8. Iterations (Megatron's
# update_train_iters): 4 while consumed <= 10 (reaching 14), then (40 - 14) // 8 = 3.
BATCHES = [2, 2, 4, 6, 8, 8, 8]
RAMP = "--rampup-batch-size 2 2 10 --global-batch-size 8 --train-samples 40 --lr-warmup-samples 4 --lr-decay-samples 40"
LR = 1e-2  # test_megatron_flag_behaviour.BASE; min-lr 0, linear decay


def _records(path):
    return {r["iteration"]: r for r in map(json.loads, open(path)) if r["kind"] == "train"}


# Thresholds in tokens / --seq-length 16: samples 0, 8, 24; until 40 samples are consumed.
STEP = "--step-batch-size-schedule 0:2,128:4,384:8 --train-samples 40 --lr-warmup-samples 4 --lr-decay-samples 40"
STEP_BATCHES = [2, 2, 2, 2, 4, 4, 4, 4, 8, 8]


def _lr_after(consumed):
    # The logged LR is the scheduler's after the step, at `consumed` samples.
    if consumed <= 4:
        return LR * consumed / 4
    return LR * max(0.0, 1.0 - (consumed - 4) / (40 - 4))


@pytest.mark.parametrize("flags,batches", [(RAMP, BATCHES), (STEP, STEP_BATCHES)], ids=["rampup", "step"])
def test_batch_sizes_consumed_samples_and_lr_follow_megatron(flags, batches, tmp_path):
    run(f"{flags} --log-dir {tmp_path}")
    records = _records(tmp_path / "metrics.jsonl")
    assert sorted(records) == list(range(1, len(batches) + 1))
    consumed = 0
    for iteration, batch in enumerate(batches, start=1):
        consumed += batch
        r = records[iteration]
        assert (r["global_batch_size"], r["consumed_samples"]) == (batch, consumed), (iteration, r)
        assert r["learning_rate"] == pytest.approx(_lr_after(consumed), abs=1e-12), iteration


def test_resume_mid_ramp_continues_the_ramp(tmp_path):
    run(f"{RAMP} --log-dir {tmp_path}/whole")
    whole = _records(tmp_path / "whole" / "metrics.jsonl")
    with pytest.raises(SystemExit):  # stops after iteration 3 (8 samples: the next batch is 6)
        run(f"{RAMP} --log-dir {tmp_path}/first --exit-interval 3 --save {tmp_path}/ckpt")
    run(f"{RAMP} --log-dir {tmp_path}/second --load {tmp_path}/ckpt")
    second = _records(tmp_path / "second" / "metrics.jsonl")
    assert sorted(second) == list(range(4, len(BATCHES) + 1))
    for iteration, r in second.items():
        for key in ("global_batch_size", "consumed_samples", "learning_rate", "lm_loss"):
            assert r[key] == whole[iteration][key], (iteration, key)


@pytest.mark.parametrize("extra,message", [
    ("--rampup-batch-size 2 2 10 --train-iters 5", "needs sample-based training: use --train-samples"),
    ("--rampup-batch-size 2 4 10 --global-batch-size 8 --train-samples 40",
     r"minus the start batch \(2\) must be a non-negative multiple of the increment \(4\)"),
    ("--rampup-batch-size 3 1 10 --global-batch-size 8 --train-samples 40",
     "multiple of --micro-batch-size x data-parallel size = 2"),
    ("--step-batch-size-schedule 0:2,128:3 --train-samples 40", r"batch sizes \[3\] are not positive multiples"),
    ("--step-batch-size-schedule 16:2 --train-samples 40", "must start at threshold 0"),
    ("--step-batch-size-schedule 0:2,1X:4 --train-samples 40", "entry '1X:4' is not TOKENS:BATCH_SIZE"),
    ("--eval-global-batch-size 3 --train-iters 2", r"--eval-global-batch-size \(3\) must be divisible by"),
])
def test_rampup_user_errors(extra, message):
    from megatron.training.arguments import parse_args
    from test_megatron_flag_behaviour import BASE

    with pytest.raises(ValueError, match=message):
        parse_args(BASE + extra.split(), world_size=1, cuda_available=False)


def test_evaluation_uses_its_own_batch_during_the_ramp(tmp_path):
    import pretrain_gpt

    training_flags = []

    def forward_step(data_iterator, model):
        training_flags.append(model.training)
        return pretrain_gpt.forward_step(data_iterator, model)

    # Micro-batches of 2: training takes sum(BATCHES) / 2; each evaluation (iterations 3
    # and 6, the end, and the test set) takes --eval-iters 2 x 6 / 2, whatever the ramp's batch.
    run(f"{RAMP} --eval-iters 2 --eval-interval 3 --eval-global-batch-size 6", forward_step=forward_step)
    assert training_flags.count(True) == sum(BATCHES) // 2
    assert training_flags.count(False) == 4 * 2 * 3


def test_a_shrinking_step_schedule_gets_enough_training_samples(tmp_path):
    # 4 samples, then 2 from sample 4 on (64 tokens / 16): 4 + 2 + 2 + 2 = 10 samples for 4
    # iterations, more than 4 x the last batch; the training set is sized for the 10.
    run(f"--step-batch-size-schedule 0:4,64:2 --train-iters 4 --log-dir {tmp_path}")
    records = _records(tmp_path / "metrics.jsonl")
    assert [records[i]["global_batch_size"] for i in range(1, 5)] == [4, 2, 2, 2]
    assert records[4]["consumed_samples"] == 10
