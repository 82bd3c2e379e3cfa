"""--rampup-batch-size START INCREMENT SAMPLES: Megatron's batch-size ramp-up.

The global batch starts at START and grows by INCREMENT every
``SAMPLES / ((GLOBAL - START) / INCREMENT)`` consumed samples until it reaches
--global-batch-size; after SAMPLES consumed samples it stays there. Only the number of
micro-batches per step changes (the micro-batch size and the data-parallel size do not),
so the data sampler, which walks the samples in micro-batch chunks, needs no change, and a
run resumed at any consumed-sample count continues the ramp where it stopped. The run
length is in samples (--train-samples), and so are the LR warmup and decay: the scheduler
advances by each step's own batch.
"""

from __future__ import annotations

import argparse
from typing import Optional


class BatchSizeRampup:
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

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Optional["BatchSizeRampup"]:
        if getattr(args, "rampup_batch_size", None) is None:
            return None
        start, increment, samples = args.rampup_batch_size
        return cls(start, increment, samples, args.final_global_batch_size,
                   args.micro_batch_size * args.data_parallel_size)

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

    def apply(self, args: argparse.Namespace, consumed_samples: int) -> None:
        """Set this step's batch: what the step, the LR scheduler and the log read."""
        args.global_batch_size = self.global_batch_size_at(consumed_samples)
        args.num_microbatches = args.global_batch_size // self.micro_batch_times_dp


def validate_rampup(args: argparse.Namespace) -> None:
    """Parse time, after the batch and run-length checks: ValueError with what to do."""
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
    args.train_iters = BatchSizeRampup.from_args(args).train_iters(args.train_samples)
