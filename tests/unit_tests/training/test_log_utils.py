"""The log line and validation box look like Megatron's; metrics reach JSONL and TensorBoard."""

import datetime
import glob
import json
import re

from megatron.training.log_utils import (
    MetricsWriter,
    format_duration,
    format_first_iteration_line,
    format_iteration_line,
    format_validation_box,
)

NOW = datetime.datetime(2026, 11, 29, 20, 0, 0)


def line(**overrides):
    kwargs = dict(
        iteration=10, train_iters=100, consumed_samples=160, elapsed_ms_per_iteration=512.3,
        learning_rate=3e-4, global_batch_size=16, losses={"lm loss": 6.123456}, grad_norm=1.2344,
        skipped_iterations=0, nan_iterations=0, tflops_per_device=0.4, tokens_per_second=4000.0,
        peak_memory_mb=812.4, now=NOW,
    )
    kwargs.update(overrides)
    return format_iteration_line(**kwargs)


def test_iteration_line_matches_the_megatron_layout_exactly():
    assert line() == (
        " [2026-11-29 20:00:00] iteration       10/     100 | consumed samples:          160 | "
        "elapsed time per iteration (ms): 512.3 | throughput per GPU (TFLOP/s/GPU): 0.400 | "
        "tokens per second: 4000.0 | learning rate: 3.000000E-04 | global batch size:    16 | "
        "lm loss: 6.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | "
        "number of nan iterations:   0 | mem (max RSS MB): 812 |"
    )


def test_throughput_fields_are_optional_and_large_values_use_one_decimal():
    s = line(tflops_per_device=None, tokens_per_second=None)
    assert "TFLOP" not in s and "tokens per second" not in s
    assert "throughput per GPU (TFLOP/s/GPU): 312.5 |" in line(tflops_per_device=312.46)


def test_megatron_log_parsers_regexes_still_match():
    s = line(memory_label="mem (max allocated MB)")
    assert re.search(r"iteration\s+(\d+)/\s*(\d+)", s).groups() == ("10", "100")
    assert float(re.search(r"lm loss: ([0-9.E+-]+)", s).group(1)) == 6.123456
    assert float(re.search(r"elapsed time per iteration \(ms\): ([0-9.]+)", s).group(1)) == 512.3
    assert "mem (max allocated MB): 812 |" in s


def test_validation_box():
    box = format_validation_box("iteration 100", {"lm loss": 2.0})
    rule, text, rule2 = box.split("\n")
    assert text == " validation loss at iteration 100 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 | "
    assert rule == rule2 == "-" * (len(text) + 1)


def test_metrics_writer_jsonl_and_tensorboard(tmp_path):
    writer = MetricsWriter(jsonl_path=str(tmp_path / "logs" / "metrics.jsonl"), tensorboard_dir=str(tmp_path / "tb"))
    writer.write("train", 10, {"lm_loss": 5.0, "learning_rate": 1e-3})
    writer.write("validation", 10, {"lm_loss": 5.5, "lm_loss_ppl": 244.7})
    writer.close()
    records = [json.loads(l) for l in open(tmp_path / "logs" / "metrics.jsonl")]
    assert [(r["kind"], r["iteration"], r["lm_loss"]) for r in records] == [("train", 10, 5.0), ("validation", 10, 5.5)]
    events = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    assert len(events) == 1

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(events[0])
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lm-loss", "learning-rate", "lm-loss validation", "lm-loss-ppl validation"} <= tags
    assert acc.Scalars("lm-loss")[0].value == 5.0 and acc.Scalars("lm-loss")[0].step == 10


def test_time_left_reads_as_a_wait():
    assert [format_duration(s) for s in (0, 41.6, 60, 460, 3599, 7500)] == ["0s", "42s", "1m00s", "7m40s", "59m59s",
                                                                         "2h05m"]
    assert line(time_left_s=460).endswith("| time left: 7m40s |")
    assert "time left" not in line()
    now = datetime.datetime(2026, 1, 2, 3, 4, 5)
    assert format_first_iteration_line(iteration=1, train_iters=200, seconds=2.31, loss=8.3, time_left_s=460,
                                       log_interval=100, now=now) == (
        " [2026-01-02 03:04:05] iteration        1/     200 | first iteration of this run (s): 2.3 |"
        " lm loss: 8.300000E+00 | time left: 7m40s | next line at iteration 100 (--log-interval 100)")
