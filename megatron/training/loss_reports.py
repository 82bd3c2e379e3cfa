"""The loss a step or an evaluation reports: its microbatches' [loss sum, token count]
reports, summed over this rank's microbatches and then over every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.distributed.comm_device import comm_device


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_sum(values) -> torch.Tensor:
    """``values`` (numbers) summed over every rank, as float64."""
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    if world_size() > 1:
        dist.all_reduce(t)
    return t


def reduce_reports(reports, key: str = "lm loss") -> torch.Tensor:
    """Sum the [loss_sum, num_tokens] reports of this rank's microbatches ([0, 0] on a
    pipeline stage that computes no loss)."""
    total = torch.zeros(2, dtype=torch.float64)
    for report in reports:
        total = total + report[key].detach().double().reshape(-1).cpu()
    return total


def mean_loss(local: torch.Tensor) -> float:
    """The per-token mean of every rank's summed reports (``local`` is this rank's sum).
    Under pipeline parallelism only the last stage reports; TP ranks report the same
    microbatches, so the ratio holds."""
    loss_sum, tokens = all_reduce_sum(local.tolist()).tolist()
    return loss_sum / max(tokens, 1.0)
