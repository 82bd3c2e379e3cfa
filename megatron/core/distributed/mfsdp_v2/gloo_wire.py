"""How the engine's all-gather and reduce-scatter travel on gloo (CPU).

torch's gloo backend implements ``reduce_scatter_tensor`` as an all-reduce of the whole
buffer followed by a copy of this rank's chunk (twice the bytes of a reduce-scatter; the
result is bitwise the all-reduce's slice), and ``all_gather_into_tensor`` queues behind
gloo's worker threads and copies. Point-to-point messages go straight to the transport,
so on gloo the engine builds both collectives from ``isend``/``irecv``, with the same
bytes on the wire as a ring collective and the same contract (the result is valid after
``wait()``); measured numbers are in benchmarks/README.md.

* all-gather: this rank's shard is copied into its place and sent to every other rank,
  each other rank's shard is received straight into its place. Pure data movement:
  bitwise what ``all_gather_into_tensor`` returns.
* reduce-scatter: each chunk of the input is sent to the rank that owns it, the N-1
  chunks for this rank are received (the first of them into the output, the rest into
  one buffer), and a post-op sums the N chunks in rank order (0, 1, ..., N-1), in the buffer's dtype. At N=2 that is bitwise gloo's
  reduce-scatter (a sum of two is commutative); at N>2 it is rank order, where gloo's own
  follows its all-reduce's chunking of the buffer, so results differ in the last bits.

Matching: gloo pairs the messages of one tag from one peer in order, and every rank
issues the engine's collectives in the same order; all-gathers and reduce-scatters,
which run on different streams and may be in flight at once, use different tags.
NCCL keeps its native collectives (``work.py`` picks by backend).
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

# Tags of the engine's point-to-point messages ("MF" + 1 or 2).
ALL_GATHER_TAG, REDUCE_SCATTER_TAG = 0x4D4601, 0x4D4602


class WorkList:
    """Several backend works waited for as one."""

    def __init__(self, works: List[dist.Work]):
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True


def all_gather(output: torch.Tensor, input: torch.Tensor, group) -> WorkList:
    """Issue the shard exchange into the flat, rank-major ``output`` (a group of one
    only copies)."""
    rank, size, n = dist.get_rank(group), dist.get_world_size(group), input.numel()
    output.narrow(0, rank * n, n).copy_(input)
    if n == 0:  # every rank's shard is empty alike: nothing to send
        return WorkList([])
    works = []
    for k in range(1, size):
        dst, src = (rank + k) % size, (rank - k) % size
        works.append(dist.isend(input, group=group, group_dst=dst, tag=ALL_GATHER_TAG))
        works.append(dist.irecv(output.narrow(0, src * n, n), group=group, group_src=src, tag=ALL_GATHER_TAG))
    return WorkList(works)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group):
    """Issue the exchange of the chunks; returns ``(work, combine)``: the post-op
    ``combine`` writes the rank-order sum of the N chunks for this rank into ``output``.
    A group of one communicates nothing (``combine`` copies).

    The first received chunk of the sum's rank order lands in ``output`` itself (which
    the sum overwrites anyway):
    at N=2 no receive buffer is allocated, elsewhere N-2 rows.
    The fold is the same, ``c0 + c1`` then ``+ c2`` ...: adding into an operand's own
    memory changes no bit of an elementwise sum."""
    rank, size, n = dist.get_rank(group), dist.get_world_size(group), output.numel()
    if size == 1 or n == 0:
        return WorkList([]), lambda: output.copy_(input.narrow(0, rank * n, n))
    if output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr():
        raise ValueError("gloo reduce-scatter: the output shares the input's storage (the sum would overwrite "
                         "chunks it still reads); reduce into a separate tensor.")
    first = 1 if rank == 0 else 0  # the lowest rank whose chunk is received: into output
    others = [j for j in range(size) if j not in (rank, first)]
    received = torch.empty((len(others), n), dtype=input.dtype, device=input.device)
    into = {first: output, **{j: received[i] for i, j in enumerate(others)}}
    works = []
    for k in range(1, size):
        dst, src = (rank + k) % size, (rank - k) % size
        works.append(dist.isend(input.narrow(0, dst * n, n), group=group, group_dst=dst, tag=REDUCE_SCATTER_TAG))
        works.append(dist.irecv(into[src], group=group, group_src=src, tag=REDUCE_SCATTER_TAG))

    def combine() -> None:
        chunks = [input.narrow(0, rank * n, n) if j == rank else into[j] for j in range(size)]
        # A left fold in the buffer's dtype (torch.sum would accumulate bf16 in fp32).
        torch.add(chunks[0], chunks[1], out=output)
        for chunk in chunks[2:]:
            output.add_(chunk)

    return WorkList(works), combine
