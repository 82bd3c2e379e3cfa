"""Where a process group's collectives take their tensors: the one answer for the trainer,
the schedules, the norms and the MoE layers (the engine asks its device handle instead)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def comm_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The current CUDA device when ``group`` (None: the default group) runs on NCCL, which
    reduces CUDA tensors only; the CPU otherwise (gloo, or no process group at all)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
