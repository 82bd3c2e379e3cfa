"""Global batch sizes that change with the consumed samples, as in Megatron-LM:

* ``--rampup-batch-size START INCREMENT SAMPLES``: start at START samples per step and
  add INCREMENT every ``SAMPLES / ((GLOBAL - START) / INCREMENT)`` consumed samples until
  --global-batch-size; after SAMPLES consumed samples it stays there. Needs --train-samples.
* ``--step-batch-size-schedule "0:384 200B:768 ..."``: from each threshold of consumed
  *tokens* (suffixes K, M, B, T; divided by --seq-length into samples) on, that batch
  size; the last one is the global batch size (so --global-batch-size is not given).

Only the number of micro-batches per step changes (the micro-batch size and the
data-parallel size do not), so the data sampler, which walks the samples in micro-batch
chunks, needs no change, and a run resumed at any consumed-sample count continues the
schedule where it stopped. The LR scheduler advances by each step's own batch.
"""

from __future__ import annotations

import argparse
from typing import List, Optional, Tuple

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


class _Schedule:
    micro_batch_times_dp: int

    def global_batch_size_at(self, consumed_samples: int) -> int:
        raise NotImplementedError

    def apply(self, args: argparse.Namespace, consumed_samples: int) -> None:
        """Set this step's batch: what the step, the LR scheduler and the log read."""
        args.global_batch_size = self.global_batch_size_at(consumed_samples)
        args.num_microbatches = args.global_batch_size // self.micro_batch_times_dp


class BatchSizeRampup(_Schedule):
    """Megatron's RampupBatchsizeNumMicroBatchesCalculator formula."""

    def __init__(self, start: int, increment: int, rampup_samples: int, global_batch_size: int,
                 micro_batch_times_dp: int):
        self.start = start
        self.increment = increment
        self.rampup_samples = rampup_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_times_dp = micro_batch_times_dp
        increments = (global_batch_size - start) // increment
        # start == global: nothing to ramp (upstream divides by zero here).
        self.samples_per_increment = rampup_samples / increments if increments else None

    def global_batch_size_at(self, consumed_samples: int) -> int:
        if consumed_samples > self.rampup_samples or self.samples_per_increment is None:
            return self.global_batch_size
        steps = int(consumed_samples / self.samples_per_increment)
        return self.start + steps * self.increment

    def train_iters(self, train_samples: int) -> int:
        """Megatron's update_train_iters: the ramp's steps (while at most SAMPLES and
        --train-samples are consumed), then whole global batches of the rest."""
        iterations, consumed = 0, 0
        while consumed <= self.rampup_samples and consumed <= train_samples:
            consumed += self.global_batch_size_at(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations


class StepBatchSizeSchedule(_Schedule):
    """Megatron's StepBatchsizeNumMicroBatchesCalculator: [(threshold in samples, batch)]."""

    def __init__(self, steps: List[Tuple[int, int]], micro_batch_times_dp: int):
        self.steps = steps
        self.micro_batch_times_dp = micro_batch_times_dp

    @staticmethod
    def parse(text: str, seq_length: int) -> List[Tuple[int, int]]:
        """'0:384 200B:768' -> [(0, 384), (200e9 // seq_length, 768)]; ValueError naming the entry."""
        steps = []
        for entry in text.replace(",", " ").split():
            threshold, sep, batch = entry.partition(":")
            try:
                if not sep:
                    raise ValueError
                steps.append((_number(threshold) // seq_length, _number(batch)))
            except ValueError:
                raise ValueError(f"--step-batch-size-schedule entry {entry!r} is not TOKENS:BATCH_SIZE "
                                 "(e.g. '0:384 200B:768'; suffixes K, M, B, T).") from None
        steps.sort()
        if not steps or steps[0][0] != 0:
            raise ValueError("--step-batch-size-schedule must start at threshold 0 (e.g. '0:384 200B:768').")
        for (a, _), (b, _) in zip(steps, steps[1:]):
            if a == b:
                raise ValueError(f"--step-batch-size-schedule has two entries at {a} samples (thresholds are "
                                 "tokens / --seq-length); make the thresholds distinct.")
        return steps

    def global_batch_size_at(self, consumed_samples: int) -> int:
        batch = self.steps[0][1]
        for threshold, size in self.steps:
            if consumed_samples < threshold:
                break
            batch = size
        return batch

    def train_iters(self, train_samples: int) -> int:
        """Megatron's update_train_iters for a step schedule: steps until --train-samples."""
        iterations, consumed = 0, 0
        while consumed < train_samples:
            consumed += self.global_batch_size_at(consumed)
            iterations += 1
        return iterations


def _number(text: str) -> int:
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def batch_size_schedule_from_args(args: argparse.Namespace) -> Optional[_Schedule]:
    chunk = args.micro_batch_size * args.data_parallel_size
    if getattr(args, "rampup_batch_size", None) is not None:
        start, increment, samples = args.rampup_batch_size
        return BatchSizeRampup(start, increment, samples, args.final_global_batch_size, chunk)
    if getattr(args, "step_batch_size_schedule", None) is not None:
        return StepBatchSizeSchedule(StepBatchSizeSchedule.parse(args.step_batch_size_schedule, args.seq_length), chunk)
    return None


def train_samples_needed(args: argparse.Namespace) -> int:
    """Samples --train-iters steps consume (the training set's size): with a schedule the
    sum of its batches, which a step schedule may make larger than iterations x the last."""
    schedule = batch_size_schedule_from_args(args)
    if schedule is None:
        return args.train_iters * args.global_batch_size
    consumed = 0
    for _ in range(args.train_iters):
        consumed += schedule.global_batch_size_at(consumed)
    return consumed


def validate_step_schedule_batch(args: argparse.Namespace) -> None:
    """Before the batch checks: the step schedule's last batch is the global batch size."""
    if args.step_batch_size_schedule is None:
        return
    if args.global_batch_size is not None:
        raise ValueError("pass only one of --step-batch-size-schedule and --global-batch-size (the schedule's last "
                         "batch size is the global batch size).")
    if args.rampup_batch_size is not None:
        raise ValueError("pass only one of --step-batch-size-schedule and --rampup-batch-size.")
    steps = StepBatchSizeSchedule.parse(args.step_batch_size_schedule, args.seq_length)
    chunk = args.micro_batch_size * args.data_parallel_size
    bad = [size for _, size in steps if size <= 0 or size % chunk]
    if bad:
        raise ValueError(f"--step-batch-size-schedule batch sizes {bad} are not positive multiples of "
                         f"--micro-batch-size x data-parallel size = {chunk}; change them or the micro-batch size.")
    args.global_batch_size = steps[-1][1]


def validate_batch_size_schedule(args: argparse.Namespace) -> None:
    """After the batch and run-length checks: ValueError with what to do; sets the
    iteration count of sample-based runs."""
    if args.step_batch_size_schedule is not None:
        args.final_global_batch_size = args.global_batch_size
        if args.train_samples is not None:
            args.train_iters = batch_size_schedule_from_args(args).train_iters(args.train_samples)
        return
    if args.rampup_batch_size is None:
        return
    start, increment, samples = args.rampup_batch_size
    if args.train_samples is None:
        raise ValueError("--rampup-batch-size needs sample-based training: use --train-samples (and "
                         "--lr-decay-samples/--lr-warmup-samples) instead of --train-iters.")
    if start <= 0 or increment <= 0 or samples < 0:
        raise ValueError(f"--rampup-batch-size {start} {increment} {samples}: the start batch and the increment must "
                         "be positive and the ramp-up samples non-negative.")
    gbs = args.global_batch_size
    if start > gbs or (gbs - start) % increment:
        raise ValueError(f"--rampup-batch-size: --global-batch-size ({gbs}) minus the start batch ({start}) must be a "
                         f"non-negative multiple of the increment ({increment}).")
    chunk = args.micro_batch_size * args.data_parallel_size
    if start % chunk or (start < gbs and increment % chunk):
        raise ValueError(f"--rampup-batch-size {start} {increment} {samples}: every batch of the ramp must be a "
                         f"multiple of --micro-batch-size x data-parallel size = {chunk}; pick a start and an "
                         f"increment divisible by {chunk}.")
    args.final_global_batch_size = gbs
    args.train_iters = batch_size_schedule_from_args(args).train_iters(args.train_samples)
