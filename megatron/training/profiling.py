"""``--profile``: a profile of training steps [--profile-step-start, --profile-step-end) on
the ranks in --profile-ranks, as upstream Megatron-LM.

With ``--use-pytorch-profiler`` (or on CPU, where upstream's other mode cannot run) the
PyTorch profiler records those steps and writes a Chrome/Perfetto JSON trace,
``rank<N>.<time>.pt.trace.json``, into --tensorboard-dir, where TensorBoard's profiler plugin
reads it. Each step is one range, ``iteration <n>`` (the iteration it completes). Without it,
on CUDA, the steps are an nsys capture range (CUDA profiler start/stop, NVTX ranges).
"""

from __future__ import annotations

import contextlib
import os

import torch


class StepProfiler:
    """Start before step ``start``, stop after step ``end - 1`` (0-based: the iteration count
    when the step begins, as upstream counts)."""

    def __init__(self, args, rank: int):
        self.enabled = bool(getattr(args, "profile", False)) and rank in args.profile_ranks
        self.start, self.end = args.profile_step_start, args.profile_step_end
        self.use_torch = args.use_pytorch_profiler or not torch.cuda.is_available()
        self.trace_dir = args.tensorboard_dir
        self.rank = rank
        self._profiler = None
        self._nvtx = None

    def step(self, iteration: int):
        """A context for the step that begins at ``iteration`` (steps completed so far)."""
        if not self.enabled:
            return contextlib.nullcontext()
        if iteration == self.start:
            self._begin()
        if self._profiler is None and self._nvtx is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"iteration {iteration + 1}")

    def after_step(self, iteration: int) -> None:
        """``iteration``: steps completed, this one included."""
        if iteration >= self.end:
            self.stop()

    def _begin(self) -> None:
        if self.use_torch:
            if self.trace_dir is None:
                return  # parse time said so: there is nowhere to write the trace
            os.makedirs(self.trace_dir, exist_ok=True)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities, record_shapes=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(self.trace_dir, worker_name=f"rank{self.rank}"))
            self._profiler.start()
        else:
            torch.cuda.profiler.start()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()

    def stop(self) -> None:
        """Ends the capture (also when training stops inside the window)."""
        if self._profiler is not None:
            self._profiler.stop()  # writes the trace (on_trace_ready)
            self._profiler = None
        if self._nvtx is not None:
            self._nvtx.__exit__(None, None, None)
            torch.cuda.profiler.stop()
            self._nvtx = None
