"""Profiler ranges of a training step's phases, for ``--profile`` traces.

While a torch profiler records, the trainer and the no-pipelining schedule run each phase
of a step inside a ``torch.profiler.record_function`` range named ``step/<phase>``:

* ``step/data``: reading the step's micro-batches from the data iterator;
* ``step/forward``: the model's forward (the loss, computed inside it, nested);
* ``step/loss``: the cross-entropy in the model's output and the loss function's masking;
* ``step/backward``: ``loss.backward()``;
* ``step/grad-finalize``: what the engine finishes after the backward (gradient reduction
  it did not overlap, the layer-norm and embedding gradient sums);
* ``step/optimizer``: clipping, the optimizer step and the LR schedule;
* ``step/logging``: the loss reduction across ranks and the step's log line and metrics.

A phase nested in another (the loss in the forward) counts for itself: a reader subtracts
nested ranges (``benchmarks/profile_vs_torchtitan.py`` does). The pipelined schedules,
whose forwards and backwards interleave, open no data/forward/backward ranges; the model's
loss range and the trainer's ranges are there all the same. Without an active profiler
nothing is opened (a record_function costs microseconds even when nobody records).
"""

from __future__ import annotations

import contextlib

import torch

from megatron.core.torch_private import profiler_enabled


def phase_range(phase: str):
    """The context of one phase's range (``step/<phase>``), or nothing when not profiling."""
    if not profiler_enabled():
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"step/{phase}")
