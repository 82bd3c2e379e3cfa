"""CollectiveWork and CollectiveCounter without a process group: a stand-in for the process
group's work object records how often it is waited on."""

import pytest
import torch

from megatron.core.distributed.mfsdp_v2.device import CpuDeviceHandle, HostStream
from megatron.core.distributed.mfsdp_v2.work import CollectiveCounter, CollectiveWork, completed_work

DEVICE = CpuDeviceHandle(torch.device("cpu"))


class FakeWork:
    def __init__(self, log, error=None):
        self.log = log
        self.error = error

    def wait(self):
        self.log.append("collective")
        if self.error is not None:
            raise self.error
        return True


def _work(log, post_ops, error=None, result=None):
    return CollectiveWork(FakeWork(log, error), DEVICE, DEVICE.new_stream("comm"), result=result, post_ops=post_ops)


def test_post_ops_run_after_the_collective_in_order():
    log = []
    result = torch.zeros(2)
    work = _work(log, [lambda: log.append("a"), lambda: log.append("b"), lambda: log.append("c")], result=result)
    assert log == []  # nothing runs before someone waits (CPU)
    assert not work.is_completed()
    assert work.wait() is result
    assert log == ["collective", "a", "b", "c"]
    assert work.is_completed()


@pytest.mark.parametrize("sequence", [
    ("wait", "wait"),
    ("block", "wait"),
    ("wait", "block"),
    ("future", "wait"),
    ("wait", "future", "future"),
])
def test_collective_and_post_ops_run_exactly_once(sequence):
    log = []
    result = torch.ones(1)
    work = _work(log, [lambda: log.append("op")], result=result)
    for how in sequence:
        if how == "wait":
            assert work.wait() is result
        elif how == "block":
            assert work.block_current_stream() is result
        else:
            future = work.get_future()
            assert future.done() and future.wait() is result
    assert log == ["collective", "op"]


def test_get_future_after_wait_returns_the_result():
    result = torch.arange(3.0)
    work = _work([], [], result=result)
    work.wait()
    assert work.get_future().wait() is result


def test_post_op_error_surfaces_from_every_wait():
    log = []

    def boom():
        raise ZeroDivisionError("division failed")

    work = _work(log, [lambda: log.append("a"), boom, lambda: log.append("never")])
    with pytest.raises(ZeroDivisionError, match="division failed") as first:
        work.wait()
    with pytest.raises(ZeroDivisionError) as second:
        work.wait()
    assert second.value is first.value
    with pytest.raises(ZeroDivisionError):
        work.block_current_stream()
    with pytest.raises(ZeroDivisionError):
        work.get_future()
    assert log == ["collective", "a"]
    assert not work.is_completed()


def test_collective_error_surfaces_from_every_wait_and_skips_post_ops():
    log = []
    work = _work(log, [lambda: log.append("op")], error=RuntimeError("gloo timeout"))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="gloo timeout"):
            work.wait()
    assert log == ["collective"]


def test_completed_work_has_nothing_to_wait_for():
    result = torch.ones(2)
    work = completed_work(DEVICE, result)
    assert work.wait() is result and work.is_completed()
    assert completed_work(DEVICE).wait() is None


def test_counter_counts_kinds_and_bytes():
    counter = CollectiveCounter()
    counter.record("all_gather", 100, 4)
    counter.record("all_gather", 28, 4)
    counter.record("reduce_scatter", 512, 4)
    assert counter.counts() == {"all_gather": 2, "reduce_scatter": 1}
    assert counter.bytes_by_kind() == {"all_gather": 128, "reduce_scatter": 512}
    counter.reset()
    assert counter.counts() == {} and counter.bytes_by_kind() == {} and counter.records == []


def test_cpu_streams_are_stand_ins_with_the_cuda_interface():
    stream = DEVICE.new_stream("x")
    assert isinstance(stream, HostStream)
    other = DEVICE.new_stream("x")
    assert stream is not other  # one object per request
    stream.wait_stream(other)
    event = stream.record_event()
    stream.wait_event(event)
    assert event.query()
    with DEVICE.stream(stream):
        pass
    assert not DEVICE.stream_ordered
