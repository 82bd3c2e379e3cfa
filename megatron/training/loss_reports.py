"""The loss a step or an evaluation reports: its microbatches' [loss sum, token count]
reports, summed over this rank's microbatches and then over every rank."""

from __future__ import annotations

import torch

from megatron.core.distributed.ranks import sum_over_ranks


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
    loss_sum, tokens = sum_over_ranks(local.tolist()).tolist()
    return loss_sum / max(tokens, 1.0)
