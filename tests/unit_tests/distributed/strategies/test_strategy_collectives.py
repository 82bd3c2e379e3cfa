"""Each strategy issues exactly its minimum communication per step.

The expected collectives are derived here from the model's parameter shapes and the
layout's shard sizes; the engine's ``ctx.counter`` must report exactly them, by kind,
bytes and group size, for every step:

* no_shard: one all-reduce per group, on the last microbatch;
* ZeRO-1: one reduce-scatter per group on the last microbatch, one all-gather of the
  updated weights per step;
* ZeRO-2: one reduce-scatter per group and microbatch, one all-gather per step;
* ZeRO-3: all-gathers in forward (every unit) and backward (every unit but the root,
  which stays unsharded between its forward and backward), one reduce-scatter per group
  and microbatch; nothing at the step;
* HSDP: ZeRO-3 inside the inner group, plus one outer all-reduce of the shard per group
  on the last microbatch;
* HFSDP: ZeRO-3 inside the inner group, plus one outer reduce-scatter per group on the
  last microbatch and one outer all-gather per group at the step.
"""

import collections
import math
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _dist_helpers import batches, check, local_rows, wrap
from _strategy_common import DistTap, Net, case_id, sharding, sizes, strategy_cases, wire_records
from megatron.core.distributed.mfsdp_v2 import MixedPrecisionPolicy, fully_shard_optimizer, microbatch

CASES = strategy_cases()

# name -> (model dtype cast in the scope, policy, compute bytes, grad-communication bytes)
PRECISIONS = {
    "fp32": (None, None, 4, 4),
    "fp32-comm_bf16": (None, MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16), 4, 2),
    "bf16": (torch.bfloat16, None, 2, 2),
    "bf16-grads_fp32": (torch.bfloat16, MixedPrecisionPolicy(main_grads_dtype=torch.float32), 2, 4),
}
RUNS = [("fp32", 1), ("fp32", 3)] + [(p, 3) for p in PRECISIONS if p != "fp32"]


def expected_collectives(case, ctx, microbatches, compute_bytes, comm_bytes):
    """{(kind, group_size): [count, bytes]} for one step, from shapes and shard sizes."""
    name = case[0]
    outer, inner = sizes(case)
    units = list(ctx.units)
    root = ctx.roots[0]
    shapes = Net.unit_shapes()
    expected = collections.defaultdict(lambda: [0, 0])

    def add(kind, group_size, count, nbytes):
        expected[(kind, group_size)][0] += count
        expected[(kind, group_size)][1] += nbytes

    mb = microbatches
    for unit, unit_shapes in zip(units, shapes):
        (group,) = unit.parameter_groups
        total = sum(math.prod(s) for s in unit_shapes)
        shards = 1 if name == "no_shard" else inner
        S, G = group.layout.shard_numel, group.layout.gathered_numel
        # The layout the counts are derived from must itself be right.
        check(G == shards * S and S >= math.ceil(total / shards), f"layout of {unit.name}: S={S}, G={G}")
        gathers_per_mb = 1 if unit is root else 2
        if name == "no_shard":
            add("all_reduce", inner, 1, total * comm_bytes)
        elif name == "zero1":
            add("reduce_scatter", inner, 1, G * comm_bytes)
            add("all_gather", inner, 1, S * compute_bytes)
        elif name == "zero2":
            add("reduce_scatter", inner, mb, mb * G * comm_bytes)
            add("all_gather", inner, 1, S * compute_bytes)
        else:  # zero3, hsdp, hfsdp: ZeRO-3 on the inner axis
            add("all_gather", inner, mb * gathers_per_mb, mb * gathers_per_mb * S * compute_bytes)
            add("reduce_scatter", inner, mb, mb * G * comm_bytes)
            if name == "hsdp":
                add("all_reduce", outer, 1, S * comm_bytes)
            elif name == "hfsdp":
                So = group.outer_layout.shard_numel
                used = group.layout.used_numel(group.shard_index)  # this rank's inner shard, unpadded
                check(So >= math.ceil(used / outer), f"outer shard {So} cannot hold {used} / {outer}")
                add("reduce_scatter", outer, 1, outer * So * comm_bytes)
                add("all_gather", outer, 1, So * compute_bytes)
    return {k: tuple(v) for k, v in expected.items()}


def measured(counter):
    out = collections.defaultdict(lambda: [0, 0])
    for record in counter.records:
        out[(record.kind, record.group_size)][0] += 1
        out[(record.kind, record.group_size)][1] += record.bytes
    return {k: tuple(v) for k, v in out.items()}


@pytest.mark.parametrize("precision,microbatches", RUNS, ids=[f"{p}-mb{m}" for p, m in RUNS])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_collectives_per_step(case, precision, microbatches):
    cast, policy, compute_bytes, comm_bytes = PRECISIONS[precision]
    torch.manual_seed(0)
    model = Net()
    ctx = wrap(model, **sharding(case), policy=policy, cast=cast)
    opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    expected = expected_collectives(case, ctx, microbatches, compute_bytes, comm_bytes)
    # The kinds and totals from the docstring, checked before comparing record by record.
    kinds = {k for k, _ in expected}
    assert kinds == {
        "no_shard": {"all_reduce"},
        "zero1": {"reduce_scatter", "all_gather"},
        "zero2": {"reduce_scatter", "all_gather"},
        "zero3": {"reduce_scatter", "all_gather"},
        "hsdp": {"reduce_scatter", "all_gather", "all_reduce"},
        "hfsdp": {"reduce_scatter", "all_gather"},
    }[case[0]]
    generator = torch.Generator().manual_seed(1)
    for step in range(2):
        ctx.counter.reset()
        opt.zero_grad()
        with DistTap() as tap:
            for i, (xb, yb) in enumerate(batches(generator, microbatches)):
                with microbatch(ctx, is_last=i == microbatches - 1):
                    x = local_rows(xb).to(cast or torch.float32)
                    y = local_rows(yb).to(cast or torch.float32)
                    F.mse_loss(model(x), y).backward()
            opt.step()
        got = measured(ctx.counter)
        check(got == expected, f"step {step}: counted {got}, expected {expected}")
        # What torch.distributed itself saw: exactly the calls that carry the counted
        # collectives, so nothing bypasses the work wrapper and its counter.
        as_records = lambda triples: measured(types.SimpleNamespace(records=[
            types.SimpleNamespace(kind=k, bytes=b, group_size=g) for k, b, g in triples]))
        engine = wire_records([(r.kind, r.bytes, r.group_size) for r in ctx.counter.records], dist.get_backend())
        check(as_records(tap.records) == as_records(engine),
              f"step {step}: torch.distributed saw {as_records(tap.records)}, the engine's collectives need "
              f"{as_records(engine)}")
        # The counter's own summaries agree with its records.
        assert ctx.counter.counts() == dict(collections.Counter(r.kind for r in ctx.counter.records))
        by_kind = collections.defaultdict(int)
        for (kind, _), (_, nbytes) in expected.items():
            by_kind[kind] += nbytes
        assert ctx.counter.bytes_by_kind() == dict(by_kind)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("zero1", "hfsdp", "no_shard", "hsdp")], ids=case_id)
def test_once_per_step_reductions_wait_for_last_microbatch(case):
    """Before the last microbatch, strategies with once-per-step reductions have issued
    none of them (no all-reduce, and no reduce-scatter for no_shard/ZeRO-1)."""
    torch.manual_seed(0)
    model = Net()
    ctx = wrap(model, **sharding(case))
    generator = torch.Generator().manual_seed(1)
    xb, yb = batches(generator, 1)[0]
    ctx.counter.reset()
    for _ in range(2):
        with microbatch(ctx, is_last=False):
            F.mse_loss(model(local_rows(xb)), local_rows(yb)).backward()
    kinds = collections.Counter(r.kind for r in ctx.counter.records)
    assert kinds["all_reduce"] == 0
    outer, inner = sizes(case)
    if case[0] in ("no_shard", "zero1"):
        assert ctx.counter.records == []
    else:  # inner reduce-scatters only: one per unit and microbatch, on the inner group
        assert kinds["reduce_scatter"] == 2 * len(ctx.units)
        assert all(r.group_size == inner for r in ctx.counter.records)
    # Finish the step cleanly so no state leaks into the next test.
    with microbatch(ctx, is_last=True):
        F.mse_loss(model(local_rows(xb)), local_rows(yb)).backward()
