"""megatron/core/distributed/ranks.py: every rank takes the same answer from its own value
(at 1, 2 and 4 ranks; in a world of one, the process answers for itself)."""

import torch.distributed as dist

from megatron.core.distributed import ranks


def test_rank_and_world_size():
    assert ranks.rank() == dist.get_rank() and ranks.world_size() == dist.get_world_size()


def test_every_rank_gets_the_same_answer():
    me, world = dist.get_rank(), dist.get_world_size()
    assert ranks.sum_over_ranks([1.0, me]).tolist() == [world, world * (world - 1) / 2]
    assert ranks.max_over_ranks(float(me)) == world - 1
    assert ranks.min_over_ranks(float(me)) == 0
    only_last = me == world - 1
    assert ranks.any_rank(only_last) is True
    assert ranks.all_ranks(only_last) is (world == 1)
    assert ranks.all_ranks(True) is True and ranks.any_rank(False) is False
