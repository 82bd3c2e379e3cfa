"""The context's replica reducer (mfsdp_v2/replica.py): HSDP whose outer reduction is an
object handed to ``fully_shard_context`` instead of a mesh axis (what the trainer's torchft
reducer plugs into). Here the object reduces on a real gloo group, the outer axis of a
(2, world/2) mesh, while the units shard over the inner axis only: training must match the
single-process reference on the global batch, under every inner strategy, with microbatches
(the replica reduction runs on the last one only)."""

import os
import sys

import pytest
import torch.distributed as dist

from _dist_helpers import check, compare_params, mesh_2d, train_pair, world
from megatron.core.distributed.mfsdp_v2 import fully_shard_context

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "strategies"))
from _strategy_common import Net  # noqa: E402


class GroupReducer:
    """ReplicaReducer over a process group: SUM there, every member live."""

    def __init__(self, group):
        self.group, self.calls = group, 0

    def all_reduce_sum(self, tensor):
        self.calls += 1
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def live_replicas(self):
        return dist.get_world_size(self.group)


@pytest.mark.parametrize("placements", ["zero3", "zero1", "no_shard"])
def test_inner_strategy_plus_replica_reducer_trains_like_the_reference(placements):
    if world() < 2:
        pytest.skip("needs two replicas (runs at 2 and 4 ranks)")
    mesh = mesh_2d((2, world() // 2))
    reducer = GroupReducer(mesh["outer"].get_group())
    model, reference, ctx, _, losses, ref_losses = train_pair(
        Net, "adamw", 2, 3, mesh=mesh["inner"], placements=placements, replica_reducer=reducer)
    compare_params(model, reference)
    check(abs(float(losses[-1]) - float(ref_losses[-1])) < 1e-5, f"{losses} vs {ref_losses}")
    # One replica reduction per parameter group per step (3 steps), none on the first microbatch.
    groups = sum(len(unit.parameter_groups) for unit in ctx.units)
    check(reducer.calls == 3 * groups, f"{reducer.calls} replica reductions for {groups} groups x 3 steps")


def test_a_reducer_without_the_protocol_is_refused():
    with pytest.raises(TypeError, match="all_reduce_sum"):
        with fully_shard_context(device="cpu", replica_reducer=object()):
            pass
