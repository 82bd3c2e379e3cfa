"""Every collective of the engine goes through this module.

A ``CollectiveWork`` wraps the process group's work object together with the post-ops
that must follow the collective (division after a SUM reduction, copy-out, dtype cast)
and the stream it ran on. Its contract is the same on every device handle:

* ``wait()``: afterwards the *current stream* may consume the result. Stream-ordered
  handles (CUDA, and the simulated streams of the checker): the current stream waits on
  the collective's event, the host does not block. CPU/gloo: the host blocks until the
  collective finished and the post-ops ran.
* ``block_current_stream()``: the same dependency without blocking the host where the
  backend allows it (CUDA); on CPU there is no other way than to block.
* ``get_future()``: calls ``block_current_stream()`` first, so a future never completes
  before the stream dependency exists.
* Post-ops run exactly once, in order, after the collective and before any consumer.

Wire algorithms: NCCL runs its native collectives. On gloo the all-gather is a
point-to-point shard exchange and the reduce-scatter a point-to-point chunk exchange
plus a local sum in rank order (``gloo_wire.py``: both are faster there than torch's gloo collectives).

Averaging: a reduction whose divisor is the group size uses ``ReduceOp.AVG`` where the
backend has it (NCCL; gloo's all-reduce on torch 2.13), one pass over the output fewer.
On gloo, AVG is bitwise equal to SUM followed by ``div_(group size)`` in fp32, bf16 and
fp16 (checked at 2, 3 and 4 ranks, and by ``test_avg_is_bitwise_sum_then_divide``), which
is what the gloo reduce-scatter does after its sum. Any other divisor (``grad_divisor``,
accumulation with a scale) keeps SUM, then divides.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import gloo_wire
from .device import DeviceHandle
from .profiling import cpu_range

PostOp = Callable[[], None]

# Profiler range names per collective kind, built once (not per call on the hot path).
_RANGES = {kind: {what: f"MFSDP {what} {kind}" for what in ("launch", "wait", "post_ops")}
           for kind in ("all_gather", "reduce_scatter", "all_reduce", "none")}


@dataclasses.dataclass
class CollectiveRecord:
    kind: str
    bytes: int
    group_size: int


class CollectiveCounter:
    """Counts collectives by kind and bytes (the input a rank contributes).

    The context owns one; tests and benchmarks read it to check that a strategy issues
    exactly the communication it promises.
    """

    def __init__(self):
        self.records: List[CollectiveRecord] = []

    def record(self, kind: str, nbytes: int, group_size: int) -> None:
        self.records.append(CollectiveRecord(kind, nbytes, group_size))

    def reset(self) -> None:
        self.records.clear()

    def counts(self) -> dict:
        return dict(collections.Counter(r.kind for r in self.records))

    def bytes_by_kind(self) -> dict:
        out: dict = collections.defaultdict(int)
        for r in self.records:
            out[r.kind] += r.bytes
        return dict(out)


class CollectiveWork:
    """An issued collective, its post-ops and the stream dependency that guards its result."""

    def __init__(
        self,
        work: Optional[dist.Work],
        device: DeviceHandle,
        stream,
        result: Optional[torch.Tensor] = None,
        post_ops: Sequence[PostOp] = (),
        keep_alive: Iterable[torch.Tensor] = (),
        kind: str = "none",
    ):
        self.kind = kind
        self._work = work
        self._device = device
        self._stream = stream
        self.result = result
        self._post_ops: List[PostOp] = list(post_ops)
        # Inputs the collective still reads must outlive it; dropped once completed.
        self._keep_alive = list(keep_alive)
        self._event = None
        self._completed = False
        self._error: Optional[BaseException] = None
        if device.stream_ordered:
            # Stream-ordered (CUDA): make the communication stream wait for the collective,
            # enqueue the post-ops behind it, and record one event that consumers wait on.
            # The host never blocks on NCCL; on the simulated streams work.wait() blocks on
            # gloo here, so the post-ops see the finished result.
            with device.stream(stream):
                if work is not None:
                    work.wait()
                self._run_post_ops()
                self._event = device.record_event(stream)

    def _run_post_ops(self) -> None:
        ops, self._post_ops = self._post_ops, []
        for op in ops:
            op()

    def _complete_on_host(self) -> None:
        """CPU path: block until gloo is done, then run the post-ops (once)."""
        if self._error is not None:
            raise self._error
        if self._completed:
            return
        try:
            # Profiler ranges: the host blocked on the backend, then the post-ops' tensor work.
            if self._work is not None:
                with cpu_range(_RANGES[self.kind]["wait"], self._device):
                    self._work.wait()
            if self._post_ops:
                with cpu_range(_RANGES[self.kind]["post_ops"], self._device):
                    self._run_post_ops()
        except BaseException as error:  # remembered so a second wait() fails the same way
            self._error = error
            raise
        self._completed = True
        self._keep_alive.clear()

    def wait(self) -> Optional[torch.Tensor]:
        """Make the result safe for the current stream and return it."""
        if self._device.stream_ordered:
            if not self._completed:
                self._device.current_stream().wait_event(self._event)
                for tensor in self._keep_alive:
                    self._device.keep_alive_for(tensor, self._stream)
                self._keep_alive.clear()
                self._completed = True
        else:
            self._complete_on_host()
        return self.result

    def block_current_stream(self) -> Optional[torch.Tensor]:
        """Stream dependency without a host block where possible (CUDA); blocks on CPU."""
        return self.wait()

    def get_future(self) -> torch.futures.Future:
        result = self.block_current_stream()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(result)
        return future

    def is_completed(self) -> bool:
        return self._completed


def completed_work(device: DeviceHandle, result: Optional[torch.Tensor] = None) -> CollectiveWork:
    """A work object for a collective that needed no communication (a group of one)."""
    return CollectiveWork(None, device, device.current_stream(), result=result)


def follow_current_stream(device: DeviceHandle, stream) -> None:
    """Order ``stream`` after everything already queued on the current stream."""
    device.stream_waits_for_current(stream)


def _launch(device: DeviceHandle, stream, kind: str, fn):
    """Issue ``fn`` on ``stream`` after everything already queued on the current stream
    (inside a profiler range ``MFSDP launch <kind>``: one per collective, whatever the
    backend's calls)."""
    follow_current_stream(device, stream)
    with device.stream(stream), cpu_range(_RANGES[kind]["launch"], device):
        return fn()


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    device: DeviceHandle,
    stream,
    post_ops: Sequence[PostOp] = (),
    counter: Optional[CollectiveCounter] = None,
) -> CollectiveWork:
    """All-gather ``input`` from every rank into the flat ``output`` (rank-major)."""
    size = dist.get_world_size(group)
    if output.numel() != input.numel() * size:
        raise ValueError(
            f"all_gather output holds {output.numel()} elements, expected {input.numel()} x {size}."
        )
    if counter is not None:
        counter.record("all_gather", input.numel() * input.element_size(), size)
    if _on_gloo(group, input):  # see gloo_wire.py: a point-to-point shard exchange is faster there
        work = _launch(device, stream, "all_gather", lambda: gloo_wire.all_gather(output, input, group))
    else:
        work = _launch(
            device, stream, "all_gather", lambda: dist.all_gather_single(output, input, group=group, async_op=True)
        )
    return CollectiveWork(work, device, stream, result=output, post_ops=post_ops, keep_alive=(input,),
                          kind="all_gather")


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    device: DeviceHandle,
    stream,
    divisor: float = 1.0,
    post_ops: Sequence[PostOp] = (),
    counter: Optional[CollectiveCounter] = None,
) -> CollectiveWork:
    """Reduce-scatter averaged over ``divisor`` (AVG, or SUM then divide; before the caller's post-ops)."""
    size = dist.get_world_size(group)
    if input.numel() != output.numel() * size:
        raise ValueError(
            f"reduce_scatter input holds {input.numel()} elements, expected {output.numel()} x {size}."
        )
    if counter is not None:
        counter.record("reduce_scatter", input.numel() * input.element_size(), size)
    if _on_gloo(group, input):  # see gloo_wire.py: chunks exchanged point to point, summed here
        work, combine = _launch(device, stream, "reduce_scatter",
                                lambda: gloo_wire.reduce_scatter(output, input, group))
        # gloo's AVG is SUM then a division by the group size: the same here, bitwise.
        ops = [combine] + ([_divide(output, divisor)] if divisor != 1 else []) + list(post_ops)
    else:
        op, division = _reduction(output, group, size, divisor)
        work = _launch(device, stream, "reduce_scatter",
                       lambda: dist.reduce_scatter_single(output, input, op=op, group=group, async_op=True))
        ops = division + list(post_ops)
    return CollectiveWork(work, device, stream, result=output, post_ops=ops, keep_alive=(input,),
                          kind="reduce_scatter")


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    device: DeviceHandle,
    stream,
    divisor: float = 1.0,
    post_ops: Sequence[PostOp] = (),
    counter: Optional[CollectiveCounter] = None,
) -> CollectiveWork:
    """In-place all-reduce averaged over ``divisor`` (AVG, or SUM then divide)."""
    size = dist.get_world_size(group)
    if counter is not None:
        counter.record("all_reduce", tensor.numel() * tensor.element_size(), size)
    op, division = _reduction(tensor, group, size, divisor)
    work = _launch(device, stream, "all_reduce", lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True))
    ops = division + list(post_ops)
    return CollectiveWork(work, device, stream, result=tensor, post_ops=ops, kind="all_reduce")


# Backends with ReduceOp.AVG for all-reduce and reduce-scatter: NCCL, and gloo in the torch
# this package pins (2.13), where it is bitwise SUM then division by the group size.
AVG_BACKENDS = ("nccl", "gloo")


def _on_gloo(group, tensor: torch.Tensor) -> bool:
    """CPU tensors on a gloo group travel by gloo_wire.py."""
    return tensor.device.type == "cpu" and dist.get_backend(group) == "gloo"


def _reduction(result: torch.Tensor, group, size: int, divisor: float):
    """(reduce op, post-ops) that average ``result`` over ``divisor``: AVG where it is the
    group's own average, else SUM and a division."""
    if divisor == size and size > 1 and dist.get_backend(group) in AVG_BACKENDS:
        return dist.ReduceOp.AVG, []
    return dist.ReduceOp.SUM, ([_divide(result, divisor)] if divisor != 1 else [])


def _divide(tensor: torch.Tensor, divisor: float) -> PostOp:
    def op() -> None:
        tensor.div_(divisor)

    return op
