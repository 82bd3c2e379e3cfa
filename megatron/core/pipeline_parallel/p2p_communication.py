"""Point-to-point messages between pipeline stages: activations forward, their gradients back.

Activations flow from stage ``r`` to ``r + 1`` (and, with virtual stages, from the last
stage back to the first, whose next chunk continues the model) on one process group;
gradients flow the other way on a second group over the same ranks. Each direction
between a pair of ranks is then one stream whose messages match in posting order, on gloo
and NCCL alike, whatever the schedule interleaves.

Sends are asynchronous and complete in the background; only receives block. A receive can
be posted ahead of the step that consumes it (``post_recv``), so the transfer overlaps the
compute before it. Every message has the schedule's fixed shape and dtype.
"""

from __future__ import annotations

import collections
from typing import Deque, List, Sequence, Tuple

import torch
import torch.distributed as dist

ACTIVATION, GRADIENT = "activation", "gradient"


class PipelineP2P:
    """The messages of one pipeline (this rank's line of ``pp`` ranks)."""

    def __init__(self, pp_group: dist.ProcessGroup, pp_grad_group: dist.ProcessGroup,
                 shape: Sequence[int], dtype: torch.dtype, device: torch.device):
        ranks = dist.get_process_group_ranks(pp_group)
        if dist.get_process_group_ranks(pp_grad_group) != ranks:
            raise ValueError("the activation and gradient groups of a pipeline must hold the same ranks, in order.")
        me = ranks.index(dist.get_rank())
        self.next_rank = ranks[(me + 1) % len(ranks)]
        self.prev_rank = ranks[(me - 1) % len(ranks)]
        self.groups = {ACTIVATION: pp_group, GRADIENT: pp_grad_group}
        self.shape: Tuple[int, ...] = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.device = device
        self._posted: dict = {ACTIVATION: collections.deque(), GRADIENT: collections.deque()}
        self._sends: List[Tuple[dist.Work, torch.Tensor]] = []

    def post_recv(self, kind: str) -> None:
        """Start receiving the next message of ``kind`` (an activation from the previous
        stage, or a gradient from the next)."""
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        source = self.prev_rank if kind == ACTIVATION else self.next_rank
        queue: Deque = self._posted[kind]
        queue.append((dist.irecv(buffer, src=source, group=self.groups[kind]), buffer))

    def posted(self, kind: str) -> int:
        return len(self._posted[kind])

    def recv(self, kind: str) -> torch.Tensor:
        """The next message of ``kind`` (posting its receive now if nothing is posted)."""
        if not self._posted[kind]:
            self.post_recv(kind)
        work, buffer = self._posted[kind].popleft()
        work.wait()
        return buffer

    def send(self, kind: str, tensor: torch.Tensor) -> None:
        """Send ``tensor`` (an activation to the next stage, or a gradient to the previous)."""
        if tuple(tensor.shape) != self.shape:
            raise RuntimeError(
                f"a pipeline stage produced a {kind} of shape {tuple(tensor.shape)}, the schedule exchanges "
                f"{self.shape} ([micro batch, sequence (/ TP under sequence parallelism), hidden]); a model chunk must "
                "keep the hidden states' shape."
            )
        payload = tensor.detach().to(self.dtype).contiguous()
        target = self.next_rank if kind == ACTIVATION else self.prev_rank
        self._sends.append((dist.isend(payload, dst=target, group=self.groups[kind]), payload))

    def finish(self) -> None:
        """Wait for every send (their buffers stay alive until then); nothing may be left posted."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        leftover = {kind: len(queue) for kind, queue in self._posted.items() if queue}
        if leftover:
            raise RuntimeError(f"pipeline receives posted but never consumed: {leftover}; the schedule's steps and "
                               "its peers' disagree.")
