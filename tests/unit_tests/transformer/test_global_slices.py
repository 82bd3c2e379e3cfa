"""GlobalSlice: a rank's piece of a global tensor, and the invariant initializer honouring it."""

import pytest
import torch
import torch.nn as nn

from megatron.core.global_slices import GlobalSlice, partition
from megatron.core.transformer.initialization import initialize_parameters_


def test_partition_rows_columns_and_blocks():
    full = torch.arange(8 * 6).view(8, 6)
    assert torch.equal(partition((8, 6), 0, 1, 2).take(full), full[4:8])
    assert torch.equal(partition((8, 6), 1, 2, 3).take(full), full[:, 4:6])
    # SwiGLU's [gate; up] rows: rank 1 of 2 keeps gate rows 2..4 and up rows 6..8.
    piece = partition((8, 6), 0, 1, 2, blocks=2)
    assert piece.ranges == ((2, 4), (6, 8))
    assert torch.equal(piece.take(full), torch.cat([full[2:4], full[6:8]]))
    assert piece.local_shape == (4, 6)


def test_a_piece_cut_along_two_dims():
    """An expert's row-parallel weight under EP x TP: rank 1 of 2's experts (rows 4..8),
    then TP rank 0 of 2's columns of them."""
    full = torch.arange(8 * 6).view(8, 6)
    experts = partition((8, 6), 0, 1, 2)
    piece = GlobalSlice(experts.global_shape, experts.dim, experts.ranges, inner=partition(experts.outer_shape, 1, 0, 2))
    assert piece.local_shape == (4, 3) and experts.outer_shape == (4, 6)
    assert torch.equal(piece.take(full), full[4:8, 0:3])
    with pytest.raises(ValueError, match="inner GlobalSlice cuts a tensor of shape"):
        GlobalSlice((8, 6), 0, ((4, 8),), inner=partition((8, 6), 1, 0, 2))


def test_bad_partitions_raise():
    with pytest.raises(ValueError, match="does not split"):
        partition((6, 2), 0, 0, 4)
    with pytest.raises(ValueError, match="outside"):
        GlobalSlice((4,), 0, ((2, 5),))
    with pytest.raises(ValueError, match="expected a global tensor"):
        partition((4, 2), 0, 0, 2).take(torch.zeros(3, 2))


class _Linear(nn.Module):
    def __init__(self, rows, cols, piece=None):
        super().__init__()
        shape = (rows, cols) if piece is None else piece.local_shape
        self.weight = nn.Parameter(torch.empty(shape))
        self.init_std = 0.02
        if piece is not None:
            self.global_slices = {"weight": piece}


def test_initializer_draws_global_and_keeps_the_piece():
    full = _Linear(8, 4)
    initialize_parameters_(full, seed=3)
    for rank in range(2):
        for dim, blocks in ((0, 1), (1, 1), (0, 2)):
            part = _Linear(8, 4, partition((8, 4), dim, rank, 2, blocks))
            initialize_parameters_(part, seed=3)
            assert torch.equal(part.weight, part.global_slices["weight"].take(full.weight.detach()))
