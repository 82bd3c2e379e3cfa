"""testing.StreamChecker and testing.SimulatedStreamsHandle on their own (no process
group): the happens-before rules and each kind of report, on hand-written stream programs."""

import pytest
import torch

from megatron.core.distributed.mfsdp_v2 import fully_shard_context
from megatron.core.distributed.mfsdp_v2.device import CpuDeviceHandle, device_handle_for
from megatron.core.distributed.mfsdp_v2.testing import SimulatedStreamsHandle, StreamChecker


def _kinds(checker):
    return sorted((r.kind, r.other.stream, r.access.stream) for r in checker.reports)


def test_vector_clocks_follow_events_waits_and_synchronize():
    handle = SimulatedStreamsHandle()
    a, b = handle.new_stream("a"), handle.new_stream("b")
    seq = a.tick()
    assert not b.ordered_after(a.id, seq) and a.ordered_after(a.id, seq)
    event = a.record_event()
    later = a.tick()  # after the record: the event does not cover it
    b.wait_event(event)
    assert b.ordered_after(a.id, seq) and not b.ordered_after(a.id, later)
    b.wait_stream(a)
    assert b.ordered_after(a.id, later)
    last = b.tick()
    assert not a.ordered_after(b.id, last)
    handle.synchronize()  # the host waited for everything: every stream is ordered after it
    assert a.ordered_after(b.id, last) and handle.default_stream.ordered_after(b.id, last)
    newcomer = handle.new_stream("c")  # created after the host wait
    assert newcomer.ordered_after(b.id, last)


def test_read_of_data_written_on_another_stream_needs_a_wait():
    with StreamChecker() as checker:
        handle = checker.handle
        side = handle.new_stream("side")
        x = torch.ones(4)
        handle.stream_waits_for_current(side)
        with handle.stream(side):
            y = x * 2
        y.sum()
        assert _kinds(checker) == [("read-after-write", "side", "default")]
        report = checker.reports[0]
        assert "aten.mul" in report.other.op and "aten.sum" in report.access.op
        assert report.access.stack and "test_stream_checker.py" in report.access.stack[0]
        handle.record_event(side).wait()  # the current stream waits on side's event
        y.sum()
        assert len(checker.reports) == 1
    with pytest.raises(AssertionError, match="read-after-write"):
        checker.assert_clean()


def test_write_racing_a_pending_read_is_reported():
    with StreamChecker() as checker:
        handle = checker.handle
        side = handle.new_stream("side")
        x = torch.ones(4)
        handle.stream_waits_for_current(side)
        with handle.stream(side):
            x.sum()
        x.add_(1)
        with handle.stream(side):
            x.mul(2)  # reads the default stream's write without waiting for it
    assert _kinds(checker) == [("read-after-write", "default", "side"), ("write-after-read", "side", "default")]


def test_host_read_orders_later_work_after_the_stream():
    with StreamChecker() as checker:
        handle = checker.handle
        side = handle.new_stream("side")
        x = torch.ones(4)
        handle.stream_waits_for_current(side)
        with handle.stream(side):
            y = x * 2
            y.sum().item()  # the host waits for side: everything issued later follows it
        y.add_(1)
    checker.assert_clean()


@pytest.mark.parametrize("protect", ["none", "record_stream", "pool_waits"])
@pytest.mark.parametrize("free", ["last_reference", "resize_to_zero"])
def test_memory_freed_while_another_stream_reads_it(free, protect):
    """The caching allocator's rule: freed memory may back the next allocation of its pool
    at once, so uses on other streams must be covered by record_stream or a wait."""
    with StreamChecker() as checker:
        handle = checker.handle
        comm = handle.new_stream("comm")
        buffer = torch.ones(16)  # allocated on the default stream's pool
        handle.stream_waits_for_current(comm)
        with handle.stream(comm):
            buffer.sum()
        if protect == "record_stream":
            handle.keep_alive_for(buffer, comm)
        elif protect == "pool_waits":
            handle.current_waits_for(comm)
        if free == "last_reference":
            del buffer
        else:
            handle.resize_storage(buffer.untyped_storage(), 0)  # as the engine frees (through its handle)
        fresh = torch.empty(16)
        fresh.fill_(3.0)  # the first write to memory the default pool handed out again
    if protect == "none":
        assert ("reuse-after-free", "comm", "default") in _kinds(checker), checker.format_reports()
        report = next(r for r in checker.reports if r.kind == "reuse-after-free")
        assert "test_stream_checker.py" in report.note  # where the memory was freed
    else:
        checker.assert_clean()


def test_resized_storage_is_a_new_allocation_of_the_current_stream():
    with StreamChecker() as checker:
        handle = checker.handle
        gather = handle.new_stream("gather")
        unsharded = torch.zeros(8)
        handle.resize_storage(unsharded.untyped_storage(), 0)
        handle.stream_waits_for_current(gather)
        with handle.stream(gather):
            handle.resize_storage(unsharded.untyped_storage(), 32)
            unsharded.fill_(1.0)  # the all-gather's write
        unsharded.sum()  # no wait on the gather stream
        assert _kinds(checker) == [("read-after-write", "gather", "default")]
        assert "resize_" in checker.reports[0].storage


def test_views_share_their_storage():
    with StreamChecker() as checker:
        handle = checker.handle
        side = handle.new_stream("side")
        flat = torch.zeros(8)
        handle.stream_waits_for_current(side)
        with handle.stream(side):
            flat[:4].fill_(1.0)
        flat[4:].sum()  # another view of the same storage
    assert _kinds(checker) == [("read-after-write", "side", "default")]


def test_contexts_get_the_simulated_handle_only_inside_the_checker():
    with StreamChecker() as checker:
        with fully_shard_context(device="cpu") as ctx:
            pass
        assert ctx.device_handle is checker.handle and ctx.device_handle.stream_ordered
        assert {ctx.allgather_stream.name, ctx.reduce_scatter_stream.name} == {"allgather", "reduce_scatter"}
    with fully_shard_context(device="cpu") as plain:
        pass
    assert isinstance(plain.device_handle, CpuDeviceHandle) and not plain.device_handle.stream_ordered
    assert isinstance(device_handle_for(torch.device("cpu")), CpuDeviceHandle)


def test_simulated_stream_contexts_refuse_foreign_streams():
    handle = SimulatedStreamsHandle()
    with pytest.raises(ValueError, match="not a stream of this simulated device"):
        with handle.stream(SimulatedStreamsHandle().new_stream("x")):
            pass
