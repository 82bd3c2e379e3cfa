"""The CP sizes each world tests and their process groups.

World 2: cp=2 over the world; world 4: cp=4 over the world and cp=2 (ranks {0, 1} and
{2, 3}); a plain pytest run (world 1): cp=1, the degenerate case.
"""

import torch.distributed as dist
from _dist_helpers import kept_groups, module_cache

WORLD = dist.get_world_size()
CP_SIZES = [WORLD] + ([2] if WORLD == 4 else [])

_GROUPS = module_cache()


def cp_group(size):
    """The group of ``size`` consecutive ranks holding this rank (every rank creates all of
    them, in the same order, the first time a size is asked for)."""
    if size == WORLD:
        return dist.group.WORLD
    if size not in _GROUPS:
        with kept_groups():
            for start in range(0, WORLD, size):
                group = dist.new_group(list(range(start, start + size)))
                if start <= dist.get_rank() < start + size:
                    _GROUPS[size] = group
    return _GROUPS[size]


# (cp, a2a size) pairs tested with 'a2a+p2p': a real a x p hierarchy at 4 ranks, and the
# degenerate ones (all a2a, all ring).
HIERARCHIES = {1: [(1, 1)], 2: [(2, 2), (2, 1)], 4: [(4, 2), (2, 2), (2, 1)]}[WORLD]

_HIERARCHICAL = module_cache()


def hierarchical_groups(cp, a2a_size):
    """(a2a group, p2p group) of this rank inside ``cp_group(cp)``: a2a groups of
    ``a2a_size`` consecutive ranks, p2p groups of every ``a2a_size``-th rank."""
    key = (cp, a2a_size)
    if key not in _HIERARCHICAL:
        cp_group(cp)  # every rank creates the groups in the same order
        rank, p = dist.get_rank(), cp // a2a_size
        mine = [None, None]
        with kept_groups():
            for start in range(0, WORLD, cp):
                for o in range(p):
                    ranks = [start + o * a2a_size + i for i in range(a2a_size)]
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        mine[0] = group
                for i in range(a2a_size):
                    ranks = [start + o * a2a_size + i for o in range(p)]
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        mine[1] = group
        _HIERARCHICAL[key] = tuple(mine)
    return _HIERARCHICAL[key]


def default_a2a_size(cp):
    """The a2a size 'a2a+p2p' uses where a test does not choose: 2 x 2 at cp=4, else 1 x cp."""
    return 2 if cp == 4 else 1


def cp_config(cp, comm_type, a2a_size=None):
    """TransformerConfig's context-parallel fields for ``cp`` ranks and ``comm_type``."""
    fields = dict(context_parallel_size=cp, cp_group=cp_group(cp), cp_comm_type=comm_type)
    if comm_type == "a2a+p2p":
        fields["hierarchical_cp_groups"] = hierarchical_groups(cp, a2a_size or default_a2a_size(cp))
    return fields
