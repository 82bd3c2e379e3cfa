"""FlatLayout on its own (no process group): whole rows, every row exactly once, equal
shards of the smallest size, views, copy round trips, empty shards, 0-d tensors.

The checks rebuild every fact from the shapes: a shard's contents are re-derived from the
pieces and compared with the tensors placed by ``copy_in``, and minimality is checked with
an independent greedy fill."""

import math

import pytest
import torch

from megatron.core.distributed.mfsdp_v2.layout import FlatLayout

SHAPE_SETS = {
    "one_matrix": [(8, 8)],
    "linear_layers": [(8, 4), (8,), (3, 8), (3,)],
    "uneven_rows": [(5, 3), (7,), (2, 2, 2), (1, 9)],
    "wide_rows": [(2, 16), (3, 5), (1,)],
    "tiny": [(1, 2), (1,)],
    "many_small": [(1,)] * 7,
    "with_empty_tensor": [(4, 3), (0, 3), (5,)],
    "wide_empty_tensor": [(0, 50), (4,)],
    "scalars_and_rows": [(), (3, 2), (), (4,)],
    "only_scalars": [(), ()],
}
SHARDS = [1, 2, 3, 4, 8]


def _rows(shape):
    return shape[0] if len(shape) > 0 else 1


def _row_numel(shape):
    return math.prod(shape[1:]) if len(shape) > 0 else 1


def _is_scalar(shape):
    return len(shape) == 0


def _greedy_fits(shapes, num_shards, capacity):
    """Independent in-order fill: scalars replicated at the front of every shard, then
    whole rows, each shard filled as far as it goes before the next one starts."""
    scalars = sum(1 for s in shapes if _is_scalar(s))
    if capacity < scalars:
        return False
    shard, used = 0, scalars
    for shape in shapes:
        if _is_scalar(shape):
            continue
        width = _row_numel(shape)
        for _ in range(_rows(shape)):
            if used + width > capacity:
                shard, used = shard + 1, scalars
                if shard >= num_shards or width > capacity - scalars:
                    return False
            used += width
    return True


def _cases():
    return [pytest.param(shapes, n, id=f"{name}-{n}") for name, shapes in SHAPE_SETS.items() for n in SHARDS]


def _numbered(shapes):
    """Distinct values everywhere: tensor i holds i*1000 + 1 + position."""
    return [torch.arange(math.prod(s), dtype=torch.float64).reshape(s) + 1000 * i + 1 for i, s in enumerate(shapes)]


@pytest.mark.parametrize("shapes,n", _cases())
def test_every_row_once_whole_rows_equal_shards(shapes, n):
    layout = FlatLayout(shapes, n)
    S = layout.shard_numel
    assert layout.gathered_numel == S * n
    for index, shape in enumerate(shapes):
        pieces = layout.pieces[index]
        if _is_scalar(shape):
            # Replicated: one copy on every shard, at the same offset.
            assert sorted(p.shard for p in pieces) == list(range(n))
            assert len({p.offset for p in pieces}) == 1
            assert all(p.numel == 1 and (p.row_start, p.row_end) == (0, 1) for p in pieces)
            continue
        # Rows in order, contiguous, each exactly once; shards non-decreasing (Shard(0) order).
        row = 0
        for piece in pieces:
            assert piece.index == index
            assert piece.row_start == row and piece.row_end > piece.row_start
            assert piece.numel == (piece.row_end - piece.row_start) * _row_numel(shape)
            row = piece.row_end
        assert row == _rows(shape)
        assert [p.shard for p in pieces] == sorted(p.shard for p in pieces)
        assert len({p.shard for p in pieces}) == len(pieces)  # one piece per shard at most
    # Inside a shard, pieces do not overlap and stay within the shard size.
    for shard in range(n):
        spans = sorted((p.offset, p.offset + p.numel) for p in layout.pieces_by_shard[shard])
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert a1 <= b0
        assert all(0 <= a0 and a1 <= S for a0, a1 in spans)
        assert layout.used_numel(shard) == sum(b - a for a, b in spans)
        assert layout.used_numel(shard) + layout.padding_numel(shard) == S
        assert layout.padding_numel(shard) >= 0


@pytest.mark.parametrize("shapes,n", _cases())
def test_shard_size_is_the_smallest_that_fits(shapes, n):
    layout = FlatLayout(shapes, n)
    S = layout.shard_numel
    total = sum(math.prod(s) for s in shapes)
    assert layout.total_numel == total
    if total == 0:
        assert S == 0
        return
    assert _greedy_fits(shapes, n, S)
    assert not _greedy_fits(shapes, n, S - 1), "a smaller shard size would do"
    # The documented bound: less than one row wasted per shard boundary.
    scalars = sum(1 for s in shapes if _is_scalar(s))
    base = math.ceil((total - scalars) / n) + scalars
    assert S <= base + max(_row_numel(s) for s in shapes if math.prod(s) > 0)
    # Padding over all shards = gathered size - what the shards store.
    stored = total + (n - 1) * scalars
    assert sum(layout.padding_numel(s) for s in range(n)) == S * n - stored


@pytest.mark.parametrize("shapes,n", _cases())
def test_copy_in_copy_out_round_trip_and_padding_untouched(shapes, n):
    layout = FlatLayout(shapes, n)
    tensors = _numbered(shapes)
    gathered = torch.full((layout.gathered_numel,), float("nan"), dtype=torch.float64)
    for index, t in enumerate(tensors):
        layout.copy_in(t, gathered, index)
    stored = layout.total_numel + (n - 1) * sum(1 for s in shapes if _is_scalar(s))
    assert int((~torch.isnan(gathered)).sum()) == stored  # nothing written into the padding
    for index, t in enumerate(tensors):
        out = torch.empty_like(t)
        layout.copy_out(gathered, index, out)
        assert torch.equal(out, t)


@pytest.mark.parametrize("shapes,n", _cases())
def test_local_views_hold_each_shards_rows(shapes, n):
    layout = FlatLayout(shapes, n)
    tensors = _numbered(shapes)
    gathered = torch.zeros(layout.gathered_numel, dtype=torch.float64)
    for index, t in enumerate(tensors):
        layout.copy_in(t, gathered, index)
    S = layout.shard_numel
    for index, (shape, t) in enumerate(zip(shapes, tensors)):
        collected = []
        for shard in range(n):
            flat_shard = gathered.narrow(0, shard * S, S)
            view = layout.local_view(flat_shard, index, shard)
            start, end, offset = layout.local_piece(index, shard)
            if _is_scalar(shape):
                assert view.shape == () and torch.equal(view, t)
                continue
            assert view.shape == (end - start,) + tuple(shape[1:])
            assert torch.equal(view, t[start:end])
            if view.numel():
                # A view, not a copy: it points into the shard at the piece's offset.
                assert view.data_ptr() == flat_shard.data_ptr() + offset * flat_shard.element_size()
                view.reshape(-1)[0] += 0  # writable in place
            collected.append(view)
        if not _is_scalar(shape):
            assert torch.equal(torch.cat(collected), t)


@pytest.mark.parametrize("shapes,n", _cases())
def test_gathered_views_and_slices(shapes, n):
    layout = FlatLayout(shapes, n)
    tensors = _numbered(shapes)
    gathered = torch.zeros(layout.gathered_numel, dtype=torch.float64)
    for index, t in enumerate(tensors):
        layout.copy_in(t, gathered, index)
    for index, (shape, t) in enumerate(zip(shapes, tensors)):
        slices = layout.gathered_slices(gathered, index)
        if _is_scalar(shape):
            assert len(slices) == n and all(torch.equal(s, t.reshape(1)) for s in slices)
        elif len(slices):
            assert torch.equal(torch.cat(slices), t.reshape(-1))
        # Split = some shard padding lies between two consecutive pieces (re-derived here
        # from the pieces' positions; a tensor spanning full shards stays unbroken).
        S = layout.shard_numel
        pieces = layout.pieces[index]
        split = not _is_scalar(shape) and any(
            b.shard * S + b.offset != a.shard * S + a.offset + a.numel for a, b in zip(pieces, pieces[1:])
        )
        assert layout.is_contiguous_in_gathered(index) == (not split)
        if split:
            with pytest.raises(ValueError):
                layout.gathered_view(gathered, index)
        else:
            view = layout.gathered_view(gathered, index)
            assert view.shape == torch.Size(shape) and torch.equal(view, t)
            if view.numel():
                assert view.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr()


def test_tensor_spanning_full_shards_is_a_view_and_padding_split_is_not():
    # 8 rows of 8 over 2 shards: shard 0 is full, so the tensor runs on unbroken.
    layout = FlatLayout([(8, 8)], 2)
    assert len(layout.pieces[0]) == 2 and layout.padding_numel(0) == 0
    assert layout.is_contiguous_in_gathered(0)
    gathered = torch.arange(float(layout.gathered_numel))
    view = layout.gathered_view(gathered, 0)
    assert view.data_ptr() == gathered.data_ptr() and torch.equal(view.reshape(-1), gathered)
    # (2,) then 3 rows of 5 over 2 shards (S = 10): shard 0 holds the vector and one row,
    # then 3 elements of padding, so the matrix is split by that padding.
    layout = FlatLayout([(2,), (3, 5)], 2)
    assert layout.shard_numel == 10 and layout.padding_numel(0) == 3
    assert layout.is_contiguous_in_gathered(0) and not layout.is_contiguous_in_gathered(1)
    matrix = torch.arange(15.0).reshape(3, 5)
    gathered = torch.full((20,), float("nan"))
    layout.copy_in(matrix, gathered, 1)
    with pytest.raises(ValueError, match="copy_out"):
        layout.gathered_view(gathered, 1)
    out = torch.empty(3, 5)
    layout.copy_out(gathered, 1, out)
    assert torch.equal(out, matrix)


def test_empty_shards():
    layout = FlatLayout([(1, 2), (1,)], 4)  # three elements, four shards
    assert layout.shard_numel == 2
    used = [layout.used_numel(s) for s in range(4)]
    assert sorted(used) == [0, 0, 1, 2]
    empty = [s for s in range(4) if used[s] == 0]
    for shard in empty:
        flat = torch.zeros(layout.shard_numel)
        assert layout.local_view(flat, 0, shard).shape == (0, 2)
        assert layout.local_view(flat, 1, shard).shape == (0,)
        assert layout.pieces_by_shard[shard] == []
        assert layout.padding_numel(shard) == layout.shard_numel
    # An empty shard's range sits where the shard order puts it (Shard(0) semantics).
    for index in range(2):
        starts = [layout.local_piece(index, s)[0] for s in range(4)]
        assert starts == sorted(starts)


def test_zero_row_and_zero_size_layouts():
    layout = FlatLayout([(0, 4)], 3)
    assert layout.shard_numel == 0 and layout.gathered_numel == 0
    assert layout.local_view(torch.zeros(0), 0, 1).shape == (0, 4)
    empty = FlatLayout([], 2)
    assert empty.shard_numel == 0 and empty.pieces == []


def test_scalars_are_replicated_at_the_front_of_every_shard():
    layout = FlatLayout([(), (6,), ()], 3)
    offsets = {index: {p.offset for p in layout.pieces[index]} for index in (0, 2)}
    assert offsets == {0: {0}, 2: {1}}
    assert layout.shard_numel == 2 + 2  # two scalar slots + a third of six rows
    vector = layout.pieces[1]
    assert [(p.shard, p.row_start, p.row_end, p.offset) for p in vector] == [(0, 0, 2, 2), (1, 2, 4, 2), (2, 4, 6, 2)]


def test_invalid_shard_count():
    with pytest.raises(ValueError, match="num_shards"):
        FlatLayout([(2,)], 0)


def test_large_layout_is_fast_and_tight():
    shapes = [(4096, 64), (4096,), (257, 3), (1,)] * 8
    layout = FlatLayout(shapes, 7)
    total = sum(math.prod(s) for s in shapes)
    assert layout.shard_numel < math.ceil(total / 7) + 64
    assert _greedy_fits(shapes, 7, layout.shard_numel)
    assert not _greedy_fits(shapes, 7, layout.shard_numel - 1)
