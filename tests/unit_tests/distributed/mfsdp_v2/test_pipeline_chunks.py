"""Several roots (pipeline chunks) in one fully_shard_context, run the way a pipeline
schedule runs them: each chunk's forwards and backwards interleaved with the other's, one
autograd backward per (chunk, microbatch), ``microbatch(ctx, is_last, module=chunk)``
around each backward.

Against a single-process reference on the global batch: the gradients are exact, each
chunk's once-per-step reductions happen once (on its own last microbatch), and a backward
of one chunk leaves the other chunk's units alone (they are neither reduced as unused nor
resharded mid-step).
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _dist_helpers import H, batches, check, compare_params, local_rows, mesh_1d, mesh_2d, world
from megatron.core.distributed.mfsdp_v2 import Placements, fully_shard, fully_shard_context, microbatch

MICROBATCHES = 2
# Interleaved order of two chunks on one rank: (kind, chunk, microbatch).
ORDER = [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 1, 0), ("F", 1, 1), ("B", 0, 0), ("B", 1, 1), ("B", 0, 1)]


class Chunk(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(H, H)
        self.second = nn.Linear(H, H)
        self.scale = nn.Parameter(torch.ones(H))  # owned by the chunk's root unit

    def forward(self, x):
        return self.second(torch.tanh(self.first(x))) * self.scale


def _run_order(ctx, chunks, data, between=None):
    """Run ORDER on ``chunks`` over the microbatches ``data``; ``between(kind, c, i)`` is
    called before each step."""
    inputs, outputs = {}, {}
    for kind, c, i in ORDER:
        if between is not None:
            between(kind, c, i)
        if kind == "F":
            x = local_rows(data[i][0]) if c == 0 else outputs[(0, i)].detach().requires_grad_()
            out = chunks[c](x)
            if c == 1:
                out = F.mse_loss(out, local_rows(data[i][1])) / MICROBATCHES
            inputs[(c, i)], outputs[(c, i)] = x, out
            continue
        if c == 1 and i == 0:
            # Chunk 0 holds microbatch 1's forward and nothing of its backward has run:
            # chunk 1's backward must not touch it.
            check(all(u.phase is u.Phase.RESTING for u in (chunks[0].first, chunks[0].second)), "chunk 0 disturbed")
        with microbatch(ctx, is_last=i == MICROBATCHES - 1, module=chunks[c]):
            if c == 1:
                outputs[(1, i)].backward()
            else:
                outputs[(0, i)].backward(inputs[(1, i)].grad)


def _layouts():
    cases = [("zero1", lambda: (mesh_1d(), Placements.zero1()), "reduce_scatter"),
             ("zero3", lambda: (mesh_1d(), Placements.zero3()), None)]
    if world() == 4:
        cases.append(("hsdp", lambda: (mesh_2d((2, 2)), Placements.hsdp("outer", "inner")), "all_reduce"))
    return cases


@pytest.mark.parametrize("name,layout,once_per_step", _layouts(), ids=[c[0] for c in _layouts()])
def test_chunks_of_one_context_reduce_once_each_and_match_the_reference(name, layout, once_per_step):
    torch.manual_seed(0)
    chunks = [Chunk(), Chunk()]
    references = copy.deepcopy(chunks)
    mesh, placements = layout()
    with fully_shard_context(device="cpu") as ctx:
        for chunk in chunks:
            fully_shard(chunk.first, mesh=mesh, placements=placements)
            fully_shard(chunk.second, mesh=mesh, placements=placements)
            fully_shard(chunk, mesh=mesh, placements=placements)
    assert ctx.roots == chunks
    data = batches(torch.Generator().manual_seed(1), MICROBATCHES)

    ctx.counter.reset()
    _run_order(ctx, chunks, data)

    if once_per_step is not None and world() > 1:
        # One reduction per unit (3 per chunk), each on its chunk's last microbatch.
        check(ctx.counter.counts().get(once_per_step, 0) == 6,
              f"{name}: {ctx.counter.counts()} (expected 6 {once_per_step})")

    loss = sum(F.mse_loss(references[1](references[0](x)), y) for x, y in data) / MICROBATCHES
    loss.backward()
    for chunk, reference in zip(chunks, references):
        compare_params(chunk, reference)


def _gathered(chunk):
    return [g.is_unsharded for unit in (chunk.first, chunk.second, chunk) for g in unit.parameter_groups]


def test_no_reshard_after_forward_keeps_chunks_gathered_across_microbatches():
    """ZeRO-3, the same step with ``set_reshard_after_forward(True)`` (every forward and
    backward gathers its unit) and ``False`` (each unit gathered once per step, kept until
    its chunk's last microbatch's backward): bitwise the same gradients, both equal to the
    reference, and the all-gathers that the two promise."""
    torch.manual_seed(0)
    base = [Chunk(), Chunk()]
    data = batches(torch.Generator().manual_seed(1), MICROBATCHES)
    grads, counts = {}, {}
    for reshard in (True, False):
        chunks = copy.deepcopy(base)
        with fully_shard_context(device="cpu") as ctx:
            for chunk in chunks:
                fully_shard(chunk.first, mesh=mesh_1d(), placements=Placements.zero3())
                fully_shard(chunk.second, mesh=mesh_1d(), placements=Placements.zero3())
                fully_shard(chunk, mesh=mesh_1d(), placements=Placements.zero3())
        for chunk in chunks:
            chunk.set_reshard_after_forward(reshard)

        def between(kind, c, i):
            # Kept: once a chunk has run a forward, all its units stay gathered until its
            # last backward; resharded: only a root holds its parameters between steps.
            if not reshard and (kind, c, i) != ORDER[0]:
                check(all(_gathered(chunks[0])), f"chunk 0 resharded before {(kind, c, i)}")

        ctx.counter.reset()
        _run_order(ctx, chunks, data, between)
        counts[reshard] = ctx.counter.counts()
        check(not any(_gathered(chunks[0]) + _gathered(chunks[1])), "a unit is still gathered after the step")
        grads[reshard] = [p.grad.to_local().clone() for chunk in chunks for p in chunk.parameters()]
        references = copy.deepcopy(base)
        loss = sum(F.mse_loss(references[1](references[0](x)), y) for x, y in data) / MICROBATCHES
        loss.backward()
        for chunk, reference in zip(chunks, references):
            compare_params(chunk, reference)
    for kept, resharded in zip(grads[False], grads[True]):
        check(torch.equal(kept, resharded), "kept and resharded gradients differ")
    # Per chunk and microbatch, resharding gathers each layer twice (forward, backward) and
    # the root once (it keeps its parameters from forward to backward); kept, each unit
    # gathers once per step. The reductions are the same.
    check(counts[True]["all_gather"] == 2 * MICROBATCHES * (2 * 2 + 1), f"resharded: {counts[True]}")
    check(counts[False]["all_gather"] == 2 * 3, f"kept: {counts[False]}")
    check(counts[True]["reduce_scatter"] == counts[False]["reduce_scatter"], f"{counts}")


def test_set_reshard_after_forward_applies_to_roots_only():
    chunk = Chunk()
    with fully_shard_context(device="cpu") as ctx:
        fully_shard(chunk.first, mesh=mesh_1d(), placements=Placements.zero3())
        fully_shard(chunk, mesh=mesh_1d(), placements=Placements.zero3())
    with pytest.raises(ValueError, match="applies to a root of the context"):
        chunk.first.set_reshard_after_forward(False)


def test_microbatch_module_must_be_a_root_of_the_context():
    chunk = Chunk()
    with fully_shard_context(device="cpu") as ctx:
        fully_shard(chunk.first, mesh=mesh_1d(), placements=Placements.zero3())
        fully_shard(chunk, mesh=mesh_1d(), placements=Placements.zero3())
    with pytest.raises(ValueError, match="is not a root of this context; pass one of context.roots"):
        with microbatch(ctx, is_last=True, module=chunk.first):
            pass
    with microbatch(ctx, is_last=False, module=chunk):
        assert ctx.is_last_microbatch is False
    assert ctx.is_last_microbatch is True
