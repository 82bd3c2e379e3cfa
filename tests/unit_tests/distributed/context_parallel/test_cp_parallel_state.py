"""The context-parallel axis of the parallel state: the CP group, the data-parallel mesh
with CP folded in (what the engine shards over) and its group, the hierarchical groups of
'a2a+p2p', and the refusals. Layouts by world: 2: cp=2; 4: cp=4, cp=2 x dp=2, cp=2 x tp=2,
HSDP 2 x cp=2, cp=4 as 2 x 2 hierarchical; 1: cp=1 (the groups equal the DP ones). The
expert view under CP: EP groups of consecutive (dp, cp) ranks of one TP coordinate."""

import pytest
import torch.distributed as dist
from _dist_helpers import rank, world

from megatron.core.parallel_state import build_parallel_state
from megatron.core.transformer.context_parallel import check_hierarchical_groups

W = world()
# (tp, cp, dp_outer, hierarchical sizes)
LAYOUTS = {1: [(1, 1, 1, None)], 2: [(1, 2, 1, None)],
           4: [(1, 4, 1, None), (1, 2, 1, None), (2, 2, 1, None), (1, 2, 2, None), (1, 4, 1, (2, 2))]}[W]


def ranks_of(group):
    return dist.get_process_group_ranks(group)


@pytest.mark.parametrize("tp,cp,outer,hierarchy", LAYOUTS)
def test_cp_groups_and_the_folded_data_parallel_mesh(tp, cp, outer, hierarchy):
    state = build_parallel_state(tp, outer, context_parallel_size=cp, hierarchical_context_parallel_sizes=hierarchy)
    dp = W // (tp * cp)
    r = rank()
    # Rank layout (dp, cp, tp), tp innermost: rank = (d * cp + c) * tp + t.
    t, c, d = r % tp, (r // tp) % cp, r // (tp * cp)
    assert (state.cp_size, state.cp_rank, state.dp_size, state.dp_rank) == (cp, c, dp, d)
    cp_ranks = [(d * cp + i) * tp + t for i in range(cp)]
    dp_cp_ranks = [j * tp + t for j in range(dp * cp)]  # the (dp, cp) ranks of this TP coordinate, flattened
    if cp == 1:
        assert state.cp_group is None and state.dp_cp_mesh is state.dp_mesh and state.dp_cp_group is state.dp_group
        return
    assert ranks_of(state.cp_group) == cp_ranks
    assert sorted(ranks_of(state.dp_cp_group)) == dp_cp_ranks
    mesh = state.dp_cp_mesh
    assert mesh.mesh_dim_names == state.dp_mesh.mesh_dim_names  # the placements read it as the DP mesh
    assert sorted(mesh.mesh.flatten().tolist()) == dp_cp_ranks
    if outer > 1:
        # HSDP: the replicas stay the outer axis; each holds inner x cp ranks (not a third axis).
        assert tuple(mesh.mesh.shape) == (outer, dp // outer * cp)
        block = dp // outer * cp
        start = r // tp // block * block
        assert ranks_of(mesh.get_group("inner")) == [(start + i) * tp + t for i in range(block)]
    else:
        assert mesh.mesh.flatten().tolist() == dp_cp_ranks  # (dp, cp) row-major: CP ranks adjacent
    if hierarchy is not None:
        a2a, p2p = state.hierarchical_cp_groups
        a = hierarchy[0]
        assert ranks_of(a2a) == cp_ranks[c // a * a:(c // a + 1) * a]
        assert ranks_of(p2p) == cp_ranks[c % a::a]
        check_hierarchical_groups(state.hierarchical_cp_groups, state.cp_group)
    else:
        assert state.hierarchical_cp_groups is None


EXPERT_LAYOUTS = {1: [(1, 1, 1, 1)], 2: [(1, 2, 1, 2), (1, 2, 1, 1)],
                  4: [(1, 2, 1, 4), (1, 2, 1, 2), (2, 2, 1, 2), (1, 2, 2, 2), (1, 4, 1, 2)]}[W]


@pytest.mark.parametrize("tp,cp,outer,ep", EXPERT_LAYOUTS)
def test_expert_view_counts_cp_ranks_as_data_parallel(tp, cp, outer, ep):
    state = build_parallel_state(tp, outer, context_parallel_size=cp, expert_model_parallel_size=ep)
    r = rank()
    t, j = r % tp, r // tp  # j: this rank's index among the (dp, cp) ranks of its TP coordinate, cp fastest
    mesh = state.expert_mesh
    names = mesh.mesh_dim_names
    assert names == (("expert_outer", "expert_inner") if outer > 1 else ("expert_dp",)) + ("ep", "tp")
    # EP: ep consecutive (dp, cp) ranks; the experts' data-parallel ranks: every ep-th one
    # (within the instance under HSDP), the same TP rank throughout.
    if ep > 1:
        assert ranks_of(mesh.get_group("ep")) == [(j // ep * ep + i) * tp + t for i in range(ep)]
    dp_cp = W // tp
    if outer == 1:
        expected = [(i * ep + j % ep) * tp + t for i in range(dp_cp // ep)]
        if dp_cp // ep > 1:
            assert ranks_of(mesh.get_group("expert_dp")) == expected
    else:
        block = dp_cp // outer  # one instance's (inner, cp) ranks
        start = j // block * block
        inner = [(start + i * ep + (j - start) % ep) * tp + t for i in range(block // ep)]
        if len(inner) > 1:
            assert ranks_of(mesh.get_group("expert_inner")) == inner
        assert ranks_of(mesh.get_group("expert_outer")) == [(o * block + j % block) * tp + t for o in range(outer)]
    if cp > 1:  # the CP group lies inside the view (the router's check)
        assert set(ranks_of(state.cp_group)) <= set(mesh.mesh.flatten().tolist())


def test_refusals_name_the_flags():
    with pytest.raises(ValueError, match=r"--context-parallel-size \(3\) x --num-distributed-optimizer-instances "
                                         rf"\(1\) must divide the world size \({W}\)"):
        build_parallel_state(1, 1, context_parallel_size=3)
    if W == 1:
        return  # the refusals below need a CP size > 1 that fits the world
    with pytest.raises(ValueError, match=rf"--hierarchical-context-parallel-sizes \(2, {W}\) must multiply to "
                                         rf"--context-parallel-size \({W}\)"):
        build_parallel_state(1, 1, context_parallel_size=W, hierarchical_context_parallel_sizes=(2, W))
