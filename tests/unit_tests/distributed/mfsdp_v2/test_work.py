"""mfsdp_v2/work.py on its own, over real gloo collectives: post-ops, exactly-once,
SUM-then-divide numerics, futures, error propagation, the collective counter."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed.mfsdp_v2 import work as comm
from megatron.core.distributed.mfsdp_v2.device import CpuDeviceHandle

DEVICE = CpuDeviceHandle(torch.device("cpu"))
STREAM = DEVICE.new_stream("test")
GROUP = None  # the default group


def _world():
    return dist.get_world_size()


def _rank():
    return dist.get_rank()


def _inputs(numel, dtype):
    """Every rank's input, computable on every rank (seeded by rank)."""
    return [torch.randn(numel, generator=torch.Generator().manual_seed(100 + r)).to(dtype) for r in range(_world())]


def _all_reduce(tensor, **kwargs):
    return comm.all_reduce(tensor, dist.group.WORLD, device=DEVICE, stream=STREAM, **kwargs)


def _reduce_scatter(output, input, **kwargs):
    return comm.reduce_scatter(output, input, dist.group.WORLD, device=DEVICE, stream=STREAM, **kwargs)


def _all_gather(output, input, **kwargs):
    return comm.all_gather(output, input, dist.group.WORLD, device=DEVICE, stream=STREAM, **kwargs)


def test_post_ops_run_in_order_after_the_division():
    tensor = torch.full((4,), float(_rank() + 1))
    log = []
    work = _all_reduce(
        tensor, divisor=_world(),
        post_ops=[lambda: log.append(("a", tensor.clone())), lambda: log.append(("b", None)),
                  lambda: log.append(("c", None))],
    )
    result = work.wait()
    assert result is tensor
    assert [name for name, _ in log] == ["a", "b", "c"]
    mean = sum(r + 1 for r in range(_world())) / _world()
    # The first post-op already saw the divided (averaged) value.
    torch.testing.assert_close(log[0][1], torch.full((4,), mean))
    torch.testing.assert_close(tensor, torch.full((4,), mean))
    assert work.is_completed()


def test_post_ops_run_exactly_once():
    counts = {"wait": 0, "block": 0, "future": 0}
    for how in counts:
        tensor = torch.ones(3)
        work = _all_reduce(tensor, post_ops=[lambda h=how: counts.__setitem__(h, counts[h] + 1)])
        if how == "wait":
            work.wait()
            work.wait()
        elif how == "block":
            work.block_current_stream()
            work.wait()
        else:
            work.get_future().wait()
            work.wait()
            work.block_current_stream()
        torch.testing.assert_close(tensor, torch.full((3,), float(_world())))  # divided never
    assert counts == {"wait": 1, "block": 1, "future": 1}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_all_reduce_sum_then_divide_is_the_mean(dtype, tol):
    inputs = _inputs(64, dtype)
    tensor = inputs[_rank()].clone()
    _all_reduce(tensor, divisor=_world()).wait()
    expected = torch.stack([t.double() for t in inputs]).mean(0)
    assert tensor.dtype == dtype
    torch.testing.assert_close(tensor.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_reduce_scatter_sum_then_divide_is_the_mean_of_my_chunk(dtype, tol):
    chunk = 8
    inputs = _inputs(chunk * _world(), dtype)
    output = torch.empty(chunk, dtype=dtype)
    work = _reduce_scatter(output, inputs[_rank()].clone(), divisor=_world())
    assert work.wait() is output
    expected = torch.stack([t.double() for t in inputs]).mean(0)[_rank() * chunk : (_rank() + 1) * chunk]
    torch.testing.assert_close(output.double(), expected, rtol=tol, atol=tol)


def test_all_gather_is_rank_major():
    inputs = _inputs(5, torch.float32)
    output = torch.empty(5 * _world())
    _all_gather(output, inputs[_rank()]).wait()
    torch.testing.assert_close(output, torch.cat(inputs), rtol=0, atol=0)


def test_get_future_after_wait_returns_the_result():
    tensor = torch.full((2,), float(_rank()))
    work = _all_reduce(tensor)
    assert work.wait() is tensor
    future = work.get_future()
    assert future.done()
    assert future.wait() is tensor
    torch.testing.assert_close(future.value(), torch.full((2,), float(sum(range(_world())))))


def test_get_future_before_wait_completes_the_work():
    tensor = torch.ones(2)
    ran = []
    work = _all_reduce(tensor, divisor=2.0, post_ops=[lambda: ran.append(1)])
    value = work.get_future().wait()
    assert ran == [1]
    torch.testing.assert_close(value, torch.full((2,), _world() / 2.0))


def test_a_failing_post_op_surfaces_from_every_wait():
    tensor = torch.ones(2)
    ran = []

    def boom():
        raise ArithmeticError("post-op failed")

    work = _all_reduce(tensor, post_ops=[lambda: ran.append("first"), boom, lambda: ran.append("never")])
    with pytest.raises(ArithmeticError, match="post-op failed") as first:
        work.wait()
    with pytest.raises(ArithmeticError, match="post-op failed") as second:
        work.wait()
    assert second.value is first.value
    with pytest.raises(ArithmeticError, match="post-op failed"):
        work.get_future()
    assert ran == ["first"]  # ops before the failure ran once, ops after it never
    assert not work.is_completed()


def test_collective_counter_counts_kinds_and_bytes():
    counter = comm.CollectiveCounter()
    n = _world()
    _all_gather(torch.empty(3 * n), torch.ones(3), counter=counter).wait()
    _all_gather(torch.empty(2 * n, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16), counter=counter).wait()
    _reduce_scatter(torch.empty(4), torch.ones(4 * n), counter=counter).wait()
    _all_reduce(torch.ones(5), counter=counter).wait()
    assert counter.counts() == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1}
    assert counter.bytes_by_kind() == {"all_gather": 3 * 4 + 2 * 2, "reduce_scatter": 4 * n * 4, "all_reduce": 5 * 4}
    assert [r.group_size for r in counter.records] == [n] * 4
    counter.reset()
    assert counter.counts() == {} and counter.bytes_by_kind() == {}


def test_size_mismatches_raise_before_communicating():
    counter = comm.CollectiveCounter()
    n = _world()
    with pytest.raises(ValueError, match="all_gather output"):
        _all_gather(torch.empty(3 * n + 1), torch.ones(3), counter=counter)
    with pytest.raises(ValueError, match="reduce_scatter input"):
        _reduce_scatter(torch.empty(4), torch.ones(4 * n + 1), counter=counter)
    assert counter.records == []
    # Nothing is left in flight: a collective right after still lines up on every rank.
    tensor = torch.ones(1)
    _all_reduce(tensor).wait()
    assert tensor.item() == n


# --------------------------------------------------------------------------------------
# The gloo wire (gloo_wire.py): point-to-point all-gathers and reduce-scatters
# --------------------------------------------------------------------------------------


def _rank_order_sum(chunks):
    total = chunks[0].clone()
    for chunk in chunks[1:]:
        total.add_(chunk)
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collectives_in_flight_together_each_get_their_own_messages(dtype):
    """Several all-gathers and reduce-scatters of different sizes issued before any wait
    (as prefetch and reductions in flight do) match their messages by tag and order:
    each result is exact, the reduce-scatters the rank-order sum of this rank's chunks."""
    n, r = _world(), _rank()
    sizes = [5, 1, 12]
    shards = {k: _inputs(k, dtype) for k in sizes}
    fulls = {k: _inputs(k * n, dtype) for k in sizes}
    works = []
    for k in sizes:
        gathered, scattered = torch.empty(k * n, dtype=dtype), torch.empty(k, dtype=dtype)
        works.append(("ag", k, _all_gather(gathered, shards[k][r].clone())))
        works.append(("rs", k, _reduce_scatter(scattered, fulls[k][r].clone(), divisor=n)))
    for kind, k, work in reversed(works):  # waited in the opposite order
        result = work.wait()
        if kind == "ag":
            assert torch.equal(result, torch.cat(shards[k]))
        else:
            expected = _rank_order_sum([full.narrow(0, r * k, k) for full in fulls[k]]).div_(n)
            assert torch.equal(result, expected)


def test_gloo_wire_on_a_subgroup_uses_group_ranks():
    """On a subgroup (the inner axis of a 2-D mesh) ranks are the group's own."""
    n = _world()
    if n % 2:
        pytest.skip("needs an even world")
    pairs = [list(range(i, i + 2)) for i in range(0, n, 2)]
    groups = [dist.new_group(ranks) for ranks in pairs]  # every rank creates every group
    mine = groups[_rank() // 2]
    local = dist.get_rank(mine)
    shard = torch.full((3,), float(_rank()))
    gathered = torch.empty(6)
    comm.all_gather(gathered, shard, mine, device=DEVICE, stream=STREAM).wait()
    base = _rank() - local
    assert torch.equal(gathered, torch.cat([torch.full((3,), float(base)), torch.full((3,), float(base + 1))]))
    full = torch.arange(4.0) + 10 * _rank()
    out = torch.empty(2)
    comm.reduce_scatter(out, full, mine, device=DEVICE, stream=STREAM).wait()
    expected = (torch.arange(4.0) + 10 * base) + (torch.arange(4.0) + 10 * (base + 1))
    assert torch.equal(out, expected.narrow(0, 2 * local, 2))


def test_gloo_reduce_scatter_refuses_an_output_inside_its_input():
    """The wire receives the first other chunk into the output and folds the sum there, so
    an output inside the input (an in-place reduce-scatter) would lose chunks before they
    are read: refused before anything is sent."""
    n, r, k = _world(), _rank(), 4
    buffer = torch.ones(k * n)
    with pytest.raises(ValueError, match="shares the input's storage"):
        _reduce_scatter(buffer.narrow(0, r * k, k), buffer)
    # The next collective still pairs its messages (nothing of the refused one was sent).
    output = torch.empty(k)
    _reduce_scatter(output, buffer.clone()).wait()
    assert torch.equal(output, torch.full((k,), float(n)))
