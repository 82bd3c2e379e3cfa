"""The load-balanced context-parallel split (single process): which tokens each CP rank
keeps, the positions it reports, the inverse, and the errors."""

import pytest
import torch

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.context_parallel import (
    check_cp_comm_type,
    context_parallel_chunks,
    context_parallel_positions,
    merge_context_parallel_splits,
    split_for_context_parallel,
)


def test_rank_keeps_chunks_r_and_mirror():
    tokens = torch.arange(16).view(1, 16) + 100
    # cp=2: 4 chunks of 4; rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2.
    assert split_for_context_parallel(tokens, 2, 0).tolist() == [[100, 101, 102, 103, 112, 113, 114, 115]]
    assert split_for_context_parallel(tokens, 2, 1).tolist() == [[104, 105, 106, 107, 108, 109, 110, 111]]
    # cp=4: 8 chunks of 2; rank 1 keeps chunks 1 and 6.
    assert split_for_context_parallel(tokens, 4, 1).tolist() == [[102, 103, 112, 113]]
    assert context_parallel_chunks(4, 1) == (1, 6)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_positions_are_the_split_of_arange(cp):
    s = 2 * cp * 3
    for rank in range(cp):
        assert torch.equal(context_parallel_positions(s, cp, rank),
                           split_for_context_parallel(torch.arange(s), cp, rank, seq_dim=0))
    every = torch.cat([context_parallel_positions(s, cp, r) for r in range(cp)])
    assert sorted(every.tolist()) == list(range(s))  # each token on exactly one rank


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("seq_dim", [0, 1, 2])
def test_merge_inverts_split(cp, seq_dim):
    shape = [3, 4, 5]
    shape[seq_dim] = 2 * cp * 2
    x = torch.randn(shape)
    pieces = [split_for_context_parallel(x, cp, r, seq_dim) for r in range(cp)]
    assert all(p.shape[seq_dim] == x.shape[seq_dim] // cp for p in pieces)
    assert torch.equal(merge_context_parallel_splits(pieces, seq_dim), x)


def test_indivisible_sequence_says_what_to_do():
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 2 \* context_parallel_size = 4; "
                                         r"pad or cut the sequences to a multiple of 4"):
        split_for_context_parallel(torch.zeros(2, 10), 2, 0)
    with pytest.raises(ValueError, match="not divisible by 2 \\* context_parallel_size = 8"):
        context_parallel_positions(12, 4, 0)


@pytest.mark.parametrize("cp_size, cp_rank, message", [
    (0, 0, "cp_size must be a positive integer"),
    (2, 2, r"cp_rank must be in \[0, 2\)"),
    (2, -1, r"cp_rank must be in \[0, 2\)"),
])
def test_bad_rank_or_size(cp_size, cp_rank, message):
    with pytest.raises(ValueError, match=message):
        split_for_context_parallel(torch.zeros(1, 8), cp_size, cp_rank)


def test_merge_refuses_odd_pieces():
    with pytest.raises(ValueError, match="piece 1 has odd length 3"):
        merge_context_parallel_splits([torch.zeros(1, 4), torch.zeros(1, 3)])


def test_comm_type_check():
    for comm_type in ("p2p", "all_gather", "a2a", "a2a+p2p"):
        check_cp_comm_type(comm_type)
    with pytest.raises(ValueError, match=r"cp_comm_type 'ring' is not supported; use one of p2p, all_gather, "
                                         r"a2a, a2a\+p2p\.$"):
        check_cp_comm_type("ring")


def test_config_needs_a_group_for_context_parallel():
    with pytest.raises(ValueError, match="context_parallel_size 2 needs cp_group, a process group of 2 ranks"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, context_parallel_size=2)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    assert (config.context_parallel_size, config.cp_group, config.cp_comm_type) == (1, None, "p2p")
