"""mfsdp_v2/flat_buffer.py over real gloo collectives: each placement change issues the
collective it names, with the values of a single-process reference; other changes raise."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed.mfsdp_v2 import work as comm
from megatron.core.distributed.mfsdp_v2.device import CpuDeviceHandle
from megatron.core.distributed.mfsdp_v2.flat_buffer import CommResources, FlatBuffer, single_axis_steps

DEVICE = CpuDeviceHandle(torch.device("cpu"))
STREAM = DEVICE.new_stream("test")


def _resources():
    return CommResources(DEVICE, STREAM, STREAM, comm.CollectiveCounter())


def _every_rank(numel):
    """Each rank's local tensor, computable on every rank."""
    return [torch.randn(numel, generator=torch.Generator().manual_seed(10 + r)) for r in range(dist.get_world_size())]


def _buffer(data, codes):
    return FlatBuffer(data, codes, (dist.group.WORLD,))


def test_shard_to_replicate_all_gathers():
    n, rank, res = dist.get_world_size(), dist.get_rank(), _resources()
    shards = _every_rank(3)
    local = _buffer(shards[rank].clone(), "S")
    full = local.like(torch.empty(3 * n), "R")
    local.redistribute(full, res, STREAM).wait()
    assert torch.equal(full.data, torch.cat(shards))
    assert res.counter.counts() == {"all_gather": 1}


def test_partial_to_shard_reduce_scatters_with_the_divisor():
    n, rank, res = dist.get_world_size(), dist.get_rank(), _resources()
    partials = _every_rank(2 * n)
    local = _buffer(partials[rank].clone(), "P")
    out = local.like(torch.empty(2), "S")
    local.redistribute(out, res, STREAM, divisor=n).wait()
    expected = (torch.stack(partials).sum(0) / n)[2 * rank:2 * rank + 2]
    torch.testing.assert_close(out.data, expected, rtol=0, atol=1e-6)
    assert res.counter.counts() == {"reduce_scatter": 1}


def test_partial_to_replicate_all_reduces_in_place():
    n, rank, res = dist.get_world_size(), dist.get_rank(), _resources()
    partials = _every_rank(5)
    local = _buffer(partials[rank].clone(), "P")
    local.redistribute(local.like(local.data, "R"), res, STREAM, divisor=n).wait()
    torch.testing.assert_close(local.data, torch.stack(partials).sum(0) / n, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="in place"):
        local.redistribute(local.like(torch.empty(5), "R"), res, STREAM)


def test_unsupported_changes_raise_before_communicating():
    res = _resources()
    buffer = _buffer(torch.zeros(4), "R")
    with pytest.raises(NotImplementedError, match="no collective"):
        buffer.redistribute(buffer.like(torch.zeros(4), "P"), res, STREAM)
    with pytest.raises(NotImplementedError, match="exactly one mesh axis"):
        buffer.redistribute(buffer.like(torch.zeros(4), "R"), res, STREAM)
    with pytest.raises(ValueError, match="does not divide"):
        _buffer(torch.zeros(1), "S").redistribute(buffer.like(torch.zeros(dist.get_world_size()), "R"), res, STREAM, divisor=2)
    with pytest.raises(ValueError, match="S, R or P"):
        _buffer(torch.zeros(1), "SS")
    assert res.counter.counts() == {}


def test_single_axis_steps_go_inner_axis_first():
    assert single_axis_steps("PP", "RS") == [(1, "PP", "PS"), (0, "PS", "RS")]
    assert single_axis_steps("PS", "SS") == [(0, "PS", "SS")]
    assert single_axis_steps("S", "S") == []
