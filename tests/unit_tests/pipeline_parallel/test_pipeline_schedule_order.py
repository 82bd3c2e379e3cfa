"""The pipeline schedules' step order and layer layouts, in one process.

The order is checked against Megatron's published formulas written out here independently
(warmup counts; the interleaved schedule's chunk/microbatch of the k-th step), and by
running every rank's order against message queues: with asynchronous sends and blocking
receives every order of a pipeline completes (no deadlock), each message is consumed by
the step that the sender meant it for, and each chunk's last backward is its microbatch
m - 1, once.
"""

import collections

import pytest

from megatron.core.pipeline_parallel.layout import build_pipeline_layout, parse_layout_string
from megatron.core.pipeline_parallel.schedules import pipeline_order


def megatron_1f1b(m, p, r):
    warmup = min(p - r - 1, m)
    steps = [("F", 0, i) for i in range(warmup)]
    for k in range(m - warmup):
        steps += [("F", 0, warmup + k), ("B", 0, k)]
    return steps + [("B", 0, i) for i in range(m - warmup, m)]


def megatron_interleaved(m, p, r, v):
    """Megatron's original interleaved schedule (microbatch groups of p, m divisible by p)."""
    total = m * v

    def chunk(k, forward):
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def microbatch(k):
        return (k // (p * v)) * p + k % p

    warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
    steps = [("F", chunk(k, True), microbatch(k)) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [("F", chunk(k + warmup, True), microbatch(k + warmup)), ("B", chunk(k, False), microbatch(k))]
    return steps + [("B", chunk(k, False), microbatch(k)) for k in range(total - warmup, total)]


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 7)])
def test_1f1b_order_is_megatrons(p, m):
    for r in range(p):
        order = pipeline_order(m, p, r)
        assert order == megatron_1f1b(m, p, r)
        warmup = next(k for k, step in enumerate(order) if step[0] == "B")
        assert warmup == min(p - r - 1, m) + (1 if m > p - r - 1 else 0)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (2, 3, 6), (4, 2, 8), (4, 2, 16), (3, 2, 6)])
def test_interleaved_order_is_megatrons(p, v, m):
    for r in range(p):
        assert pipeline_order(m, p, r, v) == megatron_interleaved(m, p, r, v)


def simulate(m, p, v, group_size=None):
    """Run every rank's order with FIFO streams; return the backward order per (rank, chunk)."""
    orders = [pipeline_order(m, p, r, v, group_size) for r in range(p)]
    position = [0] * p
    # (sender, receiver, kind) -> queue of (chunk, microbatch) the receiver will consume
    streams = collections.defaultdict(collections.deque)
    done_forward, backwards = set(), collections.defaultdict(list)

    def first(r, c):
        return r == 0 and c == 0

    def last(r, c):
        return r == p - 1 and c == v - 1

    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            if position[r] == len(orders[r]):
                continue
            kind, c, i = orders[r][position[r]]
            if kind == "F" and not first(r, c):
                queue = streams[((r - 1) % p, r, "act")]
                if not queue:
                    continue
                assert queue.popleft() == (c, i), "an activation reached the wrong forward step"
            if kind == "B" and not last(r, c):
                queue = streams[((r + 1) % p, r, "grad")]
                if not queue:
                    continue
                assert queue.popleft() == (c, i), "a gradient reached the wrong backward step"
            if kind == "F":
                assert (r, c, i) not in done_forward
                done_forward.add((r, c, i))
                if not last(r, c):
                    streams[(r, (r + 1) % p, "act")].append((c if r < p - 1 else c + 1, i))
            else:
                assert (r, c, i) in done_forward, "a backward ran before its forward"
                backwards[(r, c)].append(i)
                if not first(r, c):
                    streams[(r, (r - 1) % p, "grad")].append((c if r > 0 else c - 1, i))
            position[r] += 1
            progressed = True
    assert position == [len(o) for o in orders], f"deadlock at steps {position}"
    assert not any(streams.values())
    return backwards


@pytest.mark.parametrize("p,v,m,n", [(2, 1, 4, None), (4, 1, 3, None), (4, 1, 8, None), (2, 2, 4, None),
                                     (2, 2, 5, 3), (4, 2, 8, None), (4, 3, 12, None), (2, 4, 6, None),
                                     (4, 2, 10, 5)])
def test_every_order_runs_without_deadlock_and_each_chunk_ends_once(p, v, m, n):
    backwards = simulate(m, p, v, n)
    for r in range(p):
        for c in range(v):
            assert backwards[(r, c)] == list(range(m))  # in order: microbatch m - 1 is the chunk's last, once


def test_interleaved_group_errors():
    with pytest.raises(ValueError, match=r"must lie in \[pipeline size 4, microbatches 2\]"):
        pipeline_order(2, 4, 0, 2)
    with pytest.raises(ValueError, match="leave a last group of 1 < pipeline size 2"):
        pipeline_order(5, 2, 0, 2, 4)


def test_forward_only_runs_every_forward_in_table_order():
    assert pipeline_order(3, 2, 1, forward_only=True) == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2)]
    assert [s[:2] for s in pipeline_order(4, 2, 0, 2, forward_only=True)] == \
        [("F", 0), ("F", 0), ("F", 1), ("F", 1), ("F", 0), ("F", 0), ("F", 1), ("F", 1)]


# --- layer layouts -------------------------------------------------------------------------

def spans(layout):
    return [[list(layout.layers_of(r, v)) for v in range(layout.vp_size)] for r in range(layout.pp_size)]


def test_even_and_virtual_layouts():
    assert spans(build_pipeline_layout(8, 2)) == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    # Chunk c = v * p + r holds consecutive layers: rank 0 gets chunks 0 and 2.
    assert spans(build_pipeline_layout(8, 2, 2)) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]


def test_uneven_and_accounted_layouts():
    assert spans(build_pipeline_layout(8, 3, first_stage_layers=2, last_stage_layers=2)) == \
        [[[0, 1]], [[2, 3, 4, 5]], [[6, 7]]]
    assert spans(build_pipeline_layout(8, 2, 2, first_stage_layers=2)) == [[[0], [4]], [[1, 2, 3], [5, 6, 7]]]
    # The embedding and the loss count as a layer each: 10 "layers" over 2 stages.
    assert spans(build_pipeline_layout(8, 2, account_for_embedding=True, account_for_loss=True)) == \
        [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert spans(build_pipeline_layout(4, 3, account_for_embedding=True, account_for_loss=True)) == \
        [[[0]], [[1, 2]], [[3]]]


def test_layout_strings():
    assert parse_layout_string("Et*3|(tt|)*2tL") == ["Ettt", "tt", "tt", "tL"]
    assert spans(build_pipeline_layout(8, 2, layout="Et*3|(tt|)*2tL")) == [[[0, 1, 2], [5, 6]], [[3, 4], [7]]]
    # Upstream's MTP depths ('m') close the last chunk; they are not decoder layers.
    assert spans(build_pipeline_layout(6, 2, layout="Et*3|t*3mmL", mtp_num_layers=2)) == [[[0, 1, 2]], [[3, 4, 5]]]


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_layers=6, pp_size=4), r"--num-layers = 6 must be divisible by .* = 4"),
    (dict(num_layers=7, pp_size=2, account_for_embedding=True, account_for_loss=True), r"\(\+1 for the embedding\)"),
    (dict(num_layers=8, pp_size=2, vp_size=2, first_stage_layers=3), "multiple of the virtual stages"),
    (dict(num_layers=8, pp_size=3, first_stage_layers=3), "must split evenly"),
    (dict(num_layers=8, pp_size=2, first_stage_layers=3, last_stage_layers=3), "must split evenly"),
    (dict(num_layers=8, pp_size=2, first_stage_layers=4, account_for_loss=True), "already place every layer"),
    (dict(num_layers=8, pp_size=1, first_stage_layers=4), "need --pipeline-model-parallel-size > 1"),
    (dict(num_layers=4, pp_size=2, layout="Et|tt|tL"), "not a multiple of --pipeline-model-parallel-size"),
    (dict(num_layers=4, pp_size=2, layout="tE|ttL"), "must begin with E"),
    (dict(num_layers=5, pp_size=2, layout="Ett|ttL"), "places 4 transformer layers, --num-layers is 5"),
    (dict(num_layers=4, pp_size=2, layout="Ett|txL"), "only E .*, t .*, m .*, L"),
    (dict(num_layers=3, pp_size=2, layout="Ett|tmL"), r"places 1 multi-token prediction depths \(m\), --mtp-num-layers is 0"),
    (dict(num_layers=3, pp_size=2, layout="Ettm|tL", mtp_num_layers=1), "end the layout with 'mL'"),
])
def test_layout_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_pipeline_layout(**kwargs)
