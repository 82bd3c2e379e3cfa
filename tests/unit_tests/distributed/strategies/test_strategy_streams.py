"""The engine's CUDA stream protocol, checked on CPU: every strategy and model case trains
under ``StreamChecker`` (simulated streams, the engine's CUDA code path) with zero reports,
and losses bitwise equal to the same run on the plain CPU handle. Deliberately broken
protocols (a missing wait, an early free, a dropped event) must each be reported.

Knobs covered: mixed precision (bf16 reduction and bf16 main_grad), 1 and 2 microbatches,
activation recompute (reentrant and not), frozen, tied and unused parameters, a unit used
twice, prefetch depth 0/1/2 (a test-local override of the context's prefetch; the engine's
own depth is 1), ``max_reductions_in_flight`` 0/1/2, ``unify_communication_stream`` on/off.
"""

import functools
import os
import sys

import pytest
import torch
import torch.distributed as dist

import _dist_helpers as helpers
from _dist_helpers import check, train_pair
from _strategy_common import Net, case_id, sharding, strategy_cases
from megatron.core.distributed.mfsdp_v2 import MixedPrecisionPolicy, fully_shard_context
from megatron.core.distributed.mfsdp_v2 import backward as backward_module
from megatron.core.distributed.mfsdp_v2 import work as comm
from megatron.core.distributed.mfsdp_v2.context import FsdpContext
from megatron.core.distributed.mfsdp_v2.device import CpuDeviceHandle
from megatron.core.distributed.mfsdp_v2.testing import SimulatedStreamsHandle
from megatron.core.distributed.mfsdp_v2.testing import StreamChecker

# The model cases (frozen, tied, unused, recompute) live with the engine's own tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mfsdp_v2"))
import _mfsdp_models as models  # noqa: E402

BF16 = torch.bfloat16

# (name, policy, microbatches, prefetch depth, reductions in flight, unify streams): the
# engine's defaults (prefetch 1, one reduction in flight) run in the model cases below.
VARIANTS = [
    ("fp32-mb2-prefetch2-inflight2", None, 2, 2, 2, False),
    ("bf16grads-mb1-prefetch0-inflight0-unified",
     MixedPrecisionPolicy(main_grads_dtype=BF16, grad_comm_dtype=BF16), 1, 0, 0, True),
]


def _set_prefetch_depth(monkeypatch, depth: int) -> None:
    """Issue the all-gathers of the next ``depth`` units (the engine issues 1)."""
    for name, order in (("prefetch_forward", "forward_order"), ("prefetch_backward", "backward_order")):
        original = getattr(FsdpContext, name)

        def prefetch(self, state, original=original, order=order):
            units = getattr(self, order)
            start = units.index(state.module)
            for earlier in units[start:start + depth]:  # each prefetches its successor
                original(self, earlier._fsdp_state)

        monkeypatch.setattr(FsdpContext, name, prefetch)


def _configure(monkeypatch, prefetch: int, in_flight: int, unify: bool) -> None:
    _set_prefetch_depth(monkeypatch, prefetch)
    monkeypatch.setattr(backward_module, "MAX_REDUCTIONS_IN_FLIGHT", in_flight)
    scoped = functools.partial(fully_shard_context, unify_communication_stream=unify)
    monkeypatch.setattr(helpers, "fully_shard_context", scoped)


def _checked(run):
    """``run()`` under a fresh checker; every rank fails if any rank saw a report."""
    with StreamChecker() as checker:
        result = run()
    check(not checker.reports, checker.format_reports())
    return checker, result


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
@pytest.mark.parametrize("case", strategy_cases(), ids=case_id)
def test_strategies_keep_the_stream_protocol(case, variant, monkeypatch):
    _, policy, microbatches, prefetch, in_flight, unify = variant
    _configure(monkeypatch, prefetch, in_flight, unify)
    kwargs = {} if policy is None else {"policy": policy}
    plain = train_pair(Net, "adamw", microbatches, 2, **sharding(case), **kwargs)
    checker, checked = _checked(lambda: train_pair(Net, "adamw", microbatches, 2, **sharding(case), **kwargs))
    model, _, ctx = checked[:3]
    assert isinstance(ctx.device_handle, SimulatedStreamsHandle)
    assert isinstance(plain[2].device_handle, CpuDeviceHandle)
    assert (ctx.allgather_stream is ctx.reduce_scatter_stream) == unify
    # The simulated streams run the CUDA path on CPU tensors: data exactly as on CPU.
    assert torch.equal(checked[4], plain[4])
    if policy is None:
        torch.testing.assert_close(checked[4], checked[5], rtol=1e-4, atol=2e-5)


# (model case, unify_communication_stream): each case once, both stream layouts.
MODEL_CASES = [("frozen", False), ("tied", True), ("unused_branch", False), ("checkpoint_reentrant", True),
               ("checkpoint_nonreentrant", False), ("shared_across_reentrant_segments", True)]


@pytest.mark.parametrize("name,unify", MODEL_CASES, ids=[f"{n}-{'unified' if u else 'two-streams'}" for n, u in MODEL_CASES])
def test_model_cases_keep_the_stream_protocol(name, unify, monkeypatch):
    _configure(monkeypatch, 1, 1, unify)
    _, (_, _, _, _, losses, ref_losses) = _checked(lambda: models.train_case(models.CASES[name], "adamw", 2, steps=2))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=2e-5)


def test_unit_called_twice_keeps_the_stream_protocol():
    from test_strategy_parity import SharedUse

    _checked(lambda: train_pair(SharedUse, "sgd", 2, 2))


# --------------------------------------------------------------------------------------
# Broken protocols must be reported
# --------------------------------------------------------------------------------------


def _wire_ops(what: str) -> tuple:
    """The ops that touch a collective's data on this backend's wire (gloo_wire.py: on
    gloo the all-gather output arrives by receives; the reduce-scatter input is read by
    sends and by the post-op that sums this rank's own chunk)."""
    gloo = {"all_gather output": ("recv",), "reduce_scatter input": ("send", "aten.add")}
    native = {"all_gather output": ("allgather",), "reduce_scatter input": ("reduce_scatter",)}
    return (gloo if dist.get_backend() == "gloo" else native)[what]


def _skip_stream_waits(monkeypatch, stream_name: str) -> None:
    """Break CollectiveWork.wait for collectives on ``stream_name``: the consumer's stream
    no longer waits on the collective's event (nor keeps its input alive)."""
    original = comm.CollectiveWork.wait

    def wait(self):
        if self._stream.name == stream_name:
            self._completed = True
            return self.result
        return original(self)

    monkeypatch.setattr(comm.CollectiveWork, "wait", wait)


def _reports_from(run):
    with StreamChecker() as checker:
        run()
    return checker.reports


def _assert_reported(reports, kind, other_stream, this_stream="default"):
    found = [r for r in reports if r.kind == kind and r.other.stream == other_stream and r.access.stream == this_stream]
    check(bool(found), f"no {kind} of {other_stream} data on {this_stream}; reports:\n"
                 + "\n".join(str(r) for r in reports))
    return found


def test_missing_wait_before_using_the_gathered_buffer_is_reported(monkeypatch):
    _skip_stream_waits(monkeypatch, "allgather")
    reports = _reports_from(lambda: train_pair(Net, "sgd", 1, 1))
    found = _assert_reported(reports, "read-after-write", "allgather")
    # The all-gather's output, read by compute (on gloo it arrives by receives, gloo_wire.py).
    assert any(op in r.other.op for r in found for op in _wire_ops("all_gather output"))


def test_reduce_input_freed_before_its_collective_ends_is_reported(monkeypatch):
    original = comm.reduce_scatter

    def reduce_scatter(output, input, group, **kwargs):
        work = original(output, input, group, **kwargs)
        # The bug: free the input (as the engine frees, through its handle) while the
        # collective may still read it.
        kwargs["device"].resize_storage(input.untyped_storage(), 0)
        return work

    monkeypatch.setattr(comm, "reduce_scatter", reduce_scatter)
    reports = _reports_from(lambda: train_pair(Net, "sgd", 1, 1))
    found = _assert_reported(reports, "reuse-after-free", "reduce_scatter")
    assert any(op in r.other.op for r in found for op in _wire_ops("reduce_scatter input"))


def test_grad_exposed_without_the_reduce_scatter_event_is_reported(monkeypatch):
    _skip_stream_waits(monkeypatch, "reduce_scatter")
    reports = _reports_from(lambda: train_pair(Net, "sgd", 1, 1))
    _assert_reported(reports, "read-after-write", "reduce_scatter")


def test_collectives_are_accesses_on_their_stream():
    """A c10d op reads its input and writes its output on the stream it is issued on."""
    with StreamChecker() as checker:
        handle = checker.handle
        comm_stream = handle.new_stream("comm")
        x = torch.ones(4 * dist.get_world_size())
        out = torch.empty(4)
        handle.stream_waits_for_current(comm_stream)
        with handle.stream(comm_stream):
            dist.reduce_scatter_single(out, x, async_op=True).wait()
        out.sum()  # no wait: a race
        x.add_(1)  # writes over what the collective read: a race
        unordered = sorted((r.kind, r.other.stream, r.access.stream) for r in checker.reports)
        handle.current_waits_for(comm_stream)
        before = len(checker.reports)
        out.sum()
        x.add_(1)
    assert ("read-after-write", "comm", "default") in unordered, unordered
    assert ("write-after-read", "comm", "default") in unordered, unordered
    assert all(other == "comm" for _, other, _ in unordered), unordered
    assert len(checker.reports) == before, checker.format_reports()


CPU = CpuDeviceHandle(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avg_is_bitwise_sum_then_divide(dtype):
    """The premise of using ReduceOp.AVG for all-reduces (work.py): on gloo it equals
    SUM, then div_(n), bit for bit; and so does gloo's reduce-scatter, which at two ranks
    the engine's own (gloo_wire.py) equals bit for bit."""
    n = dist.get_world_size()
    if n == 1:
        pytest.skip("AVG is only used for groups of two or more")
    x = (torch.randn(512 * n, generator=torch.Generator().manual_seed(dist.get_rank())) * 3).to(dtype)
    sum_then_divide, avg = x.clone(), x.clone()
    dist.all_reduce(sum_then_divide)
    sum_then_divide.div_(n)
    engine = x.clone()
    comm.all_reduce(engine, dist.group.WORLD, device=CPU, stream=CPU.current_stream(), divisor=n).wait()
    assert comm._reduction(engine, dist.group.WORLD, n, n)[0] == dist.ReduceOp.AVG
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    assert torch.equal(avg, sum_then_divide)
    assert torch.equal(engine, sum_then_divide)
    scattered_sum, scattered_avg, engine = (torch.empty(512, dtype=dtype) for _ in range(3))
    dist.reduce_scatter_single(scattered_sum, x)
    scattered_sum.div_(n)
    dist.reduce_scatter_single(scattered_avg, x, op=dist.ReduceOp.AVG)
    assert torch.equal(scattered_avg, scattered_sum)
    comm.reduce_scatter(engine, x, dist.group.WORLD, device=CPU, stream=CPU.current_stream(), divisor=n).wait()
    # The engine's: this rank's chunks of every rank summed in rank order, then divided.
    everyone = torch.empty(n * x.numel(), dtype=dtype)
    dist.all_gather_into_tensor(everyone, x)
    mine = everyone.view(n, n, 512)[:, dist.get_rank()]
    folded = mine[0].clone()
    for chunk in mine[1:]:
        folded.add_(chunk)
    assert torch.equal(engine, folded.div_(n))
    if n == 2:  # a sum of two does not depend on the order: gloo's own, bit for bit
        assert torch.equal(engine, scattered_sum)
