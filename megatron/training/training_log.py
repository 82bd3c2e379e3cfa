"""What the trainer reports about training: Megatron's iteration line (and metrics.jsonl
record) every ``--log-interval`` iterations with the interval's mean loss, and the
dashboards' per-iteration scalars every ``--tensorboard-log-interval`` (Megatron's
``training_log``). Every rank calls it: the numbers behind the line are collectives.

A run's first iteration always prints a console line (a long --log-interval would otherwise
leave minutes of silence), and every line says the time left: the iterations to go at the
pace since the end of the run's first iteration (evaluation and checkpoints included; the
first iteration's warm-up excluded), or, after the first, at that iteration's own pace."""

from __future__ import annotations

import math
import time
from typing import Dict, Optional

import torch

from megatron.core import parallel_state
from megatron.core.distributed.comm_device import comm_device
from megatron.core.distributed.ranks import max_over_ranks, world_size
from megatron.core.models.gpt import flops_per_token
from megatron.core.transformer.moe.metrics import LOSS_NAMES as MOE_LOSS_NAMES
from megatron.core.transformer.moe.metrics import collect_moe_metrics, format_moe_metrics
from megatron.core.transformer.multi_token_prediction import collect_mtp_metrics
from megatron.training.log_utils import (
    format_first_iteration_line,
    format_iteration_line,
    memory_label,
    memory_scalars,
    peak_memory_mb,
    print_rank_0,
)
from megatron.training.model_builder import get_params_norm_of
from megatron.training.timers import timers_to_log

# Metrics of one iteration: TensorBoard and W&B get them every --tensorboard-log-interval
# iterations, with that iteration's values (Megatron's training_log); metrics.jsonl gets
# them every --log-interval with the console line (the loss there is the interval's mean).
ITERATION_SCALARS = ("learning_rate", "global_batch_size", "lm_loss", "grad_norm", "loss_scale", "num_zeros",
                     "params_norm")


class TrainingLog:
    """The current log interval (its steps, losses, skipped and NaN iterations, start time)
    and the sinks it is written to."""
    def __init__(self, args, built, optimizer, device, writer, timers, params):
        self.args = args
        self.built = built
        self.optimizer = optimizer
        self.device = device
        self.writer = writer
        self.timers = timers
        self.params = params
        self.grad_scaler = getattr(optimizer, "grad_scaler", None)
        self.flops_per_token = _flops_per_token(built, args)
        # Decided from the arguments, not from the (rank-0-only) writer: every rank must take
        # part in the collectives behind the per-iteration scalars.
        self.dashboards = bool(args.tensorboard_dir or args.wandb_project)
        self.num_zeros: Optional[int] = None  # the last step's (--log-num-zeros-in-grad), set by the step
        self.last_metrics: Dict[str, float] = {}
        self._params_norm = (None, None)  # (iteration, value): computed once per iteration
        self._first_done = None  # (time, iteration, seconds) at the end of this run's first iteration
        self.restart_interval()

    def restart_interval(self) -> None:
        """A new log interval, its clock started now."""
        self.loss_sum, self.loss_count, self.iterations = 0.0, 0, 0
        self.skipped_iterations = 0  # an overflow under --fp16, or a NaN/inf gradient (as Megatron counts them)
        self.nan_iterations = 0
        self.start = time.time()

    def restart_clock(self) -> None:
        """Evaluation and checkpoint time is not training time."""
        self.start = time.time()

    def record_step(self, iteration: int, loss: float, grad_norm: float, skipped: bool, consumed: int) -> None:
        """Count one finished step; write the scalars and the line when they are due."""
        args = self.args
        self.iterations += 1
        self.skipped_iterations += int(skipped)
        if math.isfinite(loss):
            self.loss_sum += loss
            self.loss_count += 1
        else:
            self.nan_iterations += 1
        if self.dashboards and iteration % args.tensorboard_log_interval == 0:
            self._write_iteration_scalars(iteration, loss, grad_norm)
        due = iteration % args.log_interval == 0 or iteration == args.train_iters
        first = self._first_done is None
        if due or first:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            now = time.time()
            if first:
                first_seconds = now - self.start
                self._first_done = (now, iteration, first_seconds)
        if due:
            seconds_per_iteration = (now - self.start) / self.iterations
            mean = self.loss_sum / self.loss_count if self.loss_count else float("nan")
            self._write_interval(iteration, seconds_per_iteration, mean, grad_norm, consumed,
                                 self._time_left(iteration, now))
            self.restart_interval()
        elif first:
            print_rank_0(format_first_iteration_line(
                iteration=iteration, train_iters=args.train_iters, seconds=first_seconds, loss=loss,
                time_left_s=self._time_left(iteration, now), log_interval=args.log_interval))

    def _time_left(self, iteration: int, now: float) -> float:
        """Seconds to --train-iters at this run's pace (see the module's docstring)."""
        done_at, first_iteration, first_seconds = self._first_done
        pace = ((now - done_at) / (iteration - first_iteration) if iteration > first_iteration else first_seconds)
        return max(0, self.args.train_iters - iteration) * pace

    def params_norm_at(self, iteration: int) -> float:
        """The L2 norm of the parameters after ``iteration`` (a collective; once per iteration)."""
        if self._params_norm[0] != iteration:
            self._params_norm = (iteration, float(get_params_norm_of(self.args, self.built, self.params)))
        return self._params_norm[1]

    def _write_interval(self, iteration: int, seconds_per_iteration: float, loss: float, grad_norm: float,
                        consumed: int, time_left_s: Optional[float] = None) -> None:
        args = self.args
        world = world_size()
        tokens_per_iteration = args.global_batch_size * args.seq_length
        tokens_per_second = tokens_per_iteration / seconds_per_iteration
        tflops = None
        if self.flops_per_token is not None:
            tflops = self.flops_per_token * tokens_per_iteration / (seconds_per_iteration * world * 1e12)
        # Peak memory: the maximum over ranks (the rank that decides whether a run fits).
        mem = max_over_ranks(peak_memory_mb(self.device))
        lr = self.optimizer.param_groups[0]["lr"]
        loss_scale = self.grad_scaler.scale if self.grad_scaler is not None else 1.0
        params_norm = self.params_norm_at(iteration) if args.log_params_norm else None
        num_zeros = self.num_zeros if args.log_num_zeros_in_grad else None
        timer_text, timer_scalars = self.timers.report(timers_to_log(args.timing_log_level), self.iterations)
        parallel = parallel_state.get_parallel_state()
        moe = collect_moe_metrics(self.built.unwrapped, comm_device(), group=parallel.dp_cp_group)  # CP ranks route their own tokens
        losses = {"lm loss": loss}
        losses.update({name: moe[name] for name in MOE_LOSS_NAMES if name in moe})
        # Every rank: under PP only the last stage runs MTP, and rank 0 prints.
        mtp = collect_mtp_metrics(self.built.unwrapped, comm_device(), depths=getattr(args, "mtp_num_layers", None))
        losses.update(mtp)  # "mtp_1 loss", ...: each depth apart
        print_rank_0(format_iteration_line(
            iteration=iteration,
            train_iters=args.train_iters,
            consumed_samples=consumed,
            elapsed_ms_per_iteration=seconds_per_iteration * 1000.0,
            learning_rate=lr,
            global_batch_size=args.global_batch_size,
            losses=losses,
            moe_text=format_moe_metrics(moe),
            grad_norm=grad_norm,
            skipped_iterations=self.skipped_iterations,
            nan_iterations=self.nan_iterations,
            loss_scale=loss_scale,
            num_zeros=num_zeros,
            params_norm=params_norm,
            tflops_per_device=tflops if args.log_throughput else None,
            tokens_per_second=tokens_per_second if args.log_throughput else None,
            peak_memory_mb=mem,
            memory_label=memory_label(self.device),
            time_left_s=time_left_s,
        ))
        if timer_text:
            print_rank_0(timer_text)
        metrics = {
            "consumed_samples": consumed,
            "elapsed_time_per_iteration_ms": seconds_per_iteration * 1000.0,
            "tokens_per_second": tokens_per_second,
            "tokens_per_second_per_device": tokens_per_second / world,
            "throughput_tflops_per_device": tflops,
            "learning_rate": lr,
            "global_batch_size": args.global_batch_size,
            "lm_loss": loss,
            "grad_norm": grad_norm,
            "skipped_iterations": self.skipped_iterations,
            "nan_iterations": self.nan_iterations,
            "peak_memory_mb": mem,
            "loss_scale": loss_scale if self.grad_scaler is not None else None,
            "num_zeros": num_zeros,
            "params_norm": params_norm,
        }
        metrics.update(moe)
        metrics.update({name.replace(" ", "_"): value for name, value in mtp.items()})
        self.last_metrics = {k: v for k, v in metrics.items() if v is not None}
        self.writer.write_record("train", iteration, self.last_metrics)
        # The dashboards get the interval's own numbers here (timing, throughput, MoE loads
        # and losses); the per-iteration ones go every --tensorboard-log-interval.
        self.writer.write_scalars("train", iteration, {k: v for k, v in self.last_metrics.items()
                                                       if k not in ITERATION_SCALARS})
        if args.log_timers_to_tensorboard:
            self.writer.write_tensorboard(iteration, {"iteration-time": seconds_per_iteration, **timer_scalars})

    def _write_iteration_scalars(self, iteration: int, loss: float, grad_norm: float) -> None:
        """Megatron's TensorBoard/W&B scalars of this one iteration: loss, learning rate,
        grad norm, ..."""
        args = self.args
        scalars = {
            "learning_rate": self.optimizer.param_groups[0]["lr"],
            "global_batch_size": args.global_batch_size,
            "lm_loss": loss,
            "grad_norm": grad_norm,
        }
        if self.grad_scaler is not None:
            scalars["loss_scale"] = self.grad_scaler.scale
        if args.log_num_zeros_in_grad:
            scalars["num_zeros"] = self.num_zeros
        if args.log_params_norm:
            scalars["params_norm"] = self.params_norm_at(iteration)
        self.writer.write_scalars("train", iteration, scalars)
        extra = {}
        if args.log_memory_to_tensorboard:
            extra.update(memory_scalars(self.device))
        if args.log_world_size_to_tensorboard:
            extra["world-size"] = world_size()
        self.writer.write_tensorboard(iteration, extra)


def _flops_per_token(built, args) -> Optional[float]:
    try:
        return float(flops_per_token(built.unwrapped.config, args.padded_vocab_size, args.seq_length))
    except (ImportError, AttributeError):
        return None
