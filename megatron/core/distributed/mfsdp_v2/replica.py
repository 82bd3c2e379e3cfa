"""An outer replica dimension that is not a mesh axis: the ``replica_reducer`` of a context.

HSDP's replica (outer) axis is normally a process group of the mesh, fixed for the job.
A fault-tolerant job instead runs each replica as its own job (its own mesh, any strategy
inside it) and leaves the replica reduction to an object that knows which replicas are
alive this step (``megatron/training/fault_tolerance.py`` adapts torchft's Manager). The
engine sees only this small protocol, so it imports no fault-tolerance library:

* ``all_reduce_sum(tensor)``: start a SUM of ``tensor`` over the live replicas, in place;
  returns a work object with ``wait()`` (a ``torch.distributed`` work).
* ``live_replicas()``: how many replicas contribute to this step's sum (read after the
  reduction, so the division uses the count the reduction actually had).

``replica_all_reduce`` wraps the reduction in a ``CollectiveWork`` like every other
collective: the division by the live count is a post-op after the SUM, on the last
microbatch only (``grad_reduction.py`` calls it once per step, after the group's own
reductions). A reducer is given to ``fully_shard_context(replica_reducer=...)``.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

from . import work as comm


@runtime_checkable
class ReplicaReducer(Protocol):
    def all_reduce_sum(self, tensor: torch.Tensor): ...

    def live_replicas(self) -> int: ...


def replica_all_reduce(tensor: torch.Tensor, reducer: ReplicaReducer, *, device, stream,
                       counter: Optional[comm.CollectiveCounter] = None, post_ops=()) -> comm.CollectiveWork:
    """SUM ``tensor`` over the live replicas in place, then divide it by their number."""
    if counter is not None:
        counter.record("replica_all_reduce", tensor.numel() * tensor.element_size(), 0)
    comm.follow_current_stream(device, stream)  # the tensor was written on the current stream
    with device.stream(stream):
        work = reducer.all_reduce_sum(tensor)

    def divide() -> None:
        tensor.div_(max(1, reducer.live_replicas()))  # 0: an errored step, never committed

    return comm.CollectiveWork(work, device, stream, result=tensor, post_ops=[divide, *post_ops],
                               kind="all_reduce")
