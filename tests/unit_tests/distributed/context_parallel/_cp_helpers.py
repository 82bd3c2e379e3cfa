"""The CP sizes each world tests and their process groups.

World 2: cp=2 over the world; world 4: cp=4 over the world and cp=2 (ranks {0, 1} and
{2, 3}); a plain pytest run (world 1): cp=1, the degenerate case.
"""

import torch.distributed as dist

WORLD = dist.get_world_size()
CP_SIZES = [WORLD] + ([2] if WORLD == 4 else [])

_GROUPS = {}


def cp_group(size):
    """The group of ``size`` consecutive ranks holding this rank (every rank creates all of
    them, in the same order, the first time a size is asked for)."""
    if size == WORLD:
        return dist.group.WORLD
    if size not in _GROUPS:
        for start in range(0, WORLD, size):
            group = dist.new_group(list(range(start, start + size)))
            if start <= dist.get_rank() < start + size:
                _GROUPS[size] = group
    return _GROUPS[size]
