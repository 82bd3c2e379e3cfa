"""Megatron-style log lines and the metric sinks (JSONL, TensorBoard, W&B).

The text formats copy Megatron-LM's (field names, widths, number formats), so tools that
parse Megatron logs read ours. Sinks exist on rank 0 only; other ranks get no-ops.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import resource
import sys
from typing import Any, Dict, Optional

import torch

from megatron.core.distributed.ranks import rank
from megatron.core.extras import MissingExtra


def print_rank_0(*message) -> None:
    """Print on rank 0 only (everywhere before the process group exists)."""
    if rank() == 0:
        print(*message, flush=True)


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: max allocated; CPU: max resident set size of this process (MB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KB on Linux and in bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def memory_scalars(device: torch.device) -> Dict[str, float]:
    """``--log-memory-to-tensorboard``: Megatron's CUDA allocator scalars; on CPU the
    process's resident set size (current and peak), which is what there is."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {
            "mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
            "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
            "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
            "mem-allocated-count": stats.get("allocation.all.current", 0),
        }
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {"mem-rss-bytes": rss_pages * os.sysconf("SC_PAGE_SIZE"),
            "mem-max-rss-bytes": peak_memory_mb(device) * 2**20}


def memory_label(device: torch.device) -> str:
    return "mem (max allocated MB)" if device.type == "cuda" else "mem (max RSS MB)"


def format_iteration_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms_per_iteration: float,
    learning_rate: float,
    global_batch_size: int,
    losses: Dict[str, float],
    grad_norm: Optional[float],
    moe_text: str = "",
    skipped_iterations: int,
    nan_iterations: int,
    loss_scale: float = 1.0,
    num_zeros: Optional[int] = None,
    params_norm: Optional[float] = None,
    tflops_per_device: Optional[float] = None,
    tokens_per_second: Optional[float] = None,
    peak_memory_mb: Optional[float] = None,
    memory_label: str = "mem (max RSS MB)",
    time_left_s: Optional[float] = None,
    now: Optional[datetime.datetime] = None,
) -> str:
    now = now or datetime.datetime.now()
    s = f" [{now.strftime('%Y-%m-%d %H:%M:%S')}]"
    s += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    s += " consumed samples: {:12d} |".format(consumed_samples)
    s += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_ms_per_iteration)
    if tflops_per_device is not None:
        # "per GPU" even on CPU: that is the label Megatron log parsers look for.
        # Megatron prints one decimal; small CPU runs would then read 0.0, so show 3 there.
        fmt = ".1f" if tflops_per_device >= 1.0 else ".3f"
        s += f" throughput per GPU (TFLOP/s/GPU): {tflops_per_device:{fmt}} |"
    if tokens_per_second is not None:
        s += f" tokens per second: {tokens_per_second:.1f} |"
    s += " learning rate: {:.6E} |".format(learning_rate)
    s += " global batch size: {:5d} |".format(global_batch_size)
    for key, value in losses.items():
        s += " {}: {:.6E} |".format(key, value)
    s += moe_text  # MoE token loads and dropped tokens (moe/metrics.py), "" for dense models
    s += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        s += " grad norm: {:.3f} |".format(grad_norm)
    if num_zeros is not None:
        s += f" num zeros: {num_zeros} |"
    if params_norm is not None:
        s += f" params norm: {params_norm:.3f} |"
    s += " number of skipped iterations: {:3d} |".format(skipped_iterations)
    s += " number of nan iterations: {:3d} |".format(nan_iterations)
    if peak_memory_mb is not None:
        s += f" {memory_label}: {peak_memory_mb:.0f} |"
    if time_left_s is not None:  # ours, not Megatron's: last, so Megatron's parsers read the rest as before
        s += f" time left: {format_duration(time_left_s)} |"
    return s


def format_duration(seconds: float) -> str:
    """``seconds`` as a person reads a wait: 42s, 7m40s, 2h05m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_first_iteration_line(*, iteration: int, train_iters: int, seconds: float, loss: float,
                                time_left_s: float, log_interval: int,
                                now: Optional[datetime.datetime] = None) -> str:
    """The console line after a run's first iteration when --log-interval is not due yet:
    that something works, how fast, and how long the run will take."""
    now = now or datetime.datetime.now()
    next_line = min(train_iters, (iteration // log_interval + 1) * log_interval)
    return (f" [{now.strftime('%Y-%m-%d %H:%M:%S')}] iteration {iteration:8d}/{train_iters:8d} |"
            f" first iteration of this run (s): {seconds:.1f} | lm loss: {loss:.6E} |"
            f" time left: {format_duration(time_left_s)} |"
            f" next line at iteration {next_line} (--log-interval {log_interval})")


def perplexity(loss: float) -> float:
    # Megatron caps the exponent at 20 so that an early, huge loss prints a number.
    return math.exp(min(20.0, loss))


def format_validation_box(prefix: str, losses: Dict[str, float], bits_per_character: Optional[float] = None) -> str:
    """Megatron's boxed evaluation report, e.g. for prefix 'iteration 100 on validation set';
    the loss in bits per character, when known, comes last."""
    s = f" validation loss at {prefix} | "
    for key, value in losses.items():
        s += "{} value: {:.6E} | ".format(key, value)
        s += "{} PPL: {:.6E} | ".format(key, perplexity(value))
    if bits_per_character is not None:
        s += "bits per character: {:.4f} | ".format(bits_per_character)
    rule = "-" * (len(s) + 1)
    return "\n".join([rule, s, rule])


def _tb_tag(key: str) -> str:
    return key.replace("_", "-")


class MetricsWriter:
    """Sends metrics to metrics.jsonl, TensorBoard and W&B (whichever are configured)."""
    def __init__(self, jsonl_path: Optional[str] = None, tensorboard_dir: Optional[str] = None,
                 wandb_project: Optional[str] = None, wandb_exp_name: Optional[str] = None,
                 wandb_save_dir: Optional[str] = None, config: Optional[Dict[str, Any]] = None,
                 wandb_entity: Optional[str] = None):
        self.jsonl_path = jsonl_path
        self._jsonl = None
        self.tensorboard = None
        self.wandb_run = None
        if jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            # Append: a resumed run continues the same file.
            self._jsonl = open(jsonl_path, "a", buffering=1)
        if tensorboard_dir:
            # Optional dependency (MEGATRON_EXTRAS=logging): only --tensorboard-dir needs it.
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(tensorboard_dir, exist_ok=True)
            self.tensorboard = SummaryWriter(log_dir=tensorboard_dir, max_queue=1000)
        if wandb_project:
            self.wandb_run = _init_wandb(wandb_project, wandb_exp_name, wandb_save_dir, config or {}, wandb_entity)

    def write(self, kind: str, iteration: int, metrics: Dict[str, Any]) -> None:
        """One record to metrics.jsonl, and its numbers to TensorBoard and W&B."""
        self.write_record(kind, iteration, metrics)
        self.write_scalars(kind, iteration, metrics)

    def write_record(self, kind: str, iteration: int, metrics: Dict[str, Any]) -> None:
        """metrics.jsonl only."""
        record = {"kind": kind, "iteration": iteration, **metrics,
                  "time": datetime.datetime.now().isoformat(timespec="seconds")}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")

    def write_scalars(self, kind: str, iteration: int, metrics: Dict[str, Any]) -> None:
        """TensorBoard (tag: the key with '-' for '_', then the kind unless 'train') and W&B
        ('kind/key'); values that are not numbers are left out."""
        scalars = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                tag = _tb_tag(key) if kind == "train" else f"{_tb_tag(key)} {kind}"
                self.tensorboard.add_scalar(tag, value, iteration)
        if self.wandb_run is not None:
            self.wandb_run.log({f"{kind}/{k}": v for k, v in scalars.items()}, step=iteration)

    def write_tensorboard(self, iteration: int, scalars: Dict[str, float]) -> None:
        """Scalars under Megatron's own TensorBoard tags, verbatim (e.g. 'lm loss validation ppl')."""
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, float(value), iteration)

    def flush(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _init_wandb(project: str, name: Optional[str], save_dir: Optional[str], config: Dict[str, Any],
                entity: Optional[str] = None):
    try:
        import wandb  # imported here: the optional 'logging' extra
    except ImportError:
        raise MissingExtra("wandb", "--wandb-project") from None
    # Offline (files only, synced later with `wandb sync`) unless the user can log in.
    mode = os.environ.get("WANDB_MODE")
    if mode is None:
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    save_dir = save_dir or os.getcwd()
    os.makedirs(save_dir, exist_ok=True)
    return wandb.init(project=project, name=name, dir=save_dir, config=config, mode=mode, entity=entity)


def jsonable_config(args) -> Dict[str, Any]:
    out = {}
    for key, value in vars(args).items():
        if isinstance(value, (int, float, str, bool)) or value is None:
            out[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (int, float, str)) for v in value):
            out[key] = list(value)
        else:
            out[key] = str(value)
    return out
