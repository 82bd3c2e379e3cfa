"""Who this process is among the ranks, and how the ranks agree on one answer.

The one place for "rank 0 without a process group" and for the small all-reduces that make
every rank take the same decision from its own reading (a clock, a signal flag, a finished
sequence): a decision taken on one rank alone would leave the others waiting in a collective.
Each function works without a process group too (a single process: its own answer). The
engine's checkpoint code agrees on errors with its own ``Comm`` (it gathers messages, not
numbers); everything else uses this module.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .comm_device import comm_device


def rank(group: Optional[dist.ProcessGroup] = None) -> int:
    """This process's rank in ``group`` (None: the world); 0 without a process group."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def world_size(group: Optional[dist.ProcessGroup] = None) -> int:
    """The ranks in ``group`` (None: the world); 1 without a process group."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _reduced(values: Sequence[float], op, group) -> torch.Tensor:
    t = torch.tensor(list(values), dtype=torch.float64, device=comm_device(group))
    if world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t.cpu()


def sum_over_ranks(values: Sequence[float], group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``values`` (numbers) summed over the ranks of ``group``, as a float64 CPU tensor."""
    return _reduced(values, dist.ReduceOp.SUM, group)


def max_over_ranks(value: float, group: Optional[dist.ProcessGroup] = None) -> float:
    return float(_reduced([value], dist.ReduceOp.MAX, group)[0])


def min_over_ranks(value: float, group: Optional[dist.ProcessGroup] = None) -> float:
    return float(_reduced([value], dist.ReduceOp.MIN, group)[0])


def any_rank(flag: bool, group: Optional[dist.ProcessGroup] = None) -> bool:
    """True on every rank when ``flag`` is true on at least one."""
    return max_over_ranks(1.0 if flag else 0.0, group) > 0


def all_ranks(flag: bool, group: Optional[dist.ProcessGroup] = None) -> bool:
    """True on every rank when ``flag`` is true on all of them."""
    return min_over_ranks(1.0 if flag else 0.0, group) > 0
