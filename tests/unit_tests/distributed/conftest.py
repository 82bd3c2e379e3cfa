"""Process-group setup for the distributed tests.

Run under ``python -m torch.distributed.run --nproc-per-node N -m pytest tests/unit_tests/distributed``.
Run plainly with pytest, the same tests run in a world of one rank. Every group has a
short timeout, so a rank that skips a collective fails the run instead of hanging it.

This folder goes on ``sys.path`` once, so every test folder below imports the shared
helpers by name (``from _dist_helpers import wrap``).
"""

import datetime
import gc
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

PG_TIMEOUT = datetime.timedelta(seconds=60)

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def _init_world():
    if dist.is_initialized():
        return
    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    else:
        store_file = tempfile.mktemp(prefix="mfsdp_test_store_")
        dist.init_process_group(
            "gloo", init_method=f"file://{store_file}", rank=0, world_size=1, timeout=PG_TIMEOUT
        )


def pytest_configure(config):
    _init_world()


def pytest_unconfigure(config):
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session", autouse=True)
def _imports_frozen():
    """What the session imported (torch, megatron, every test module: about 250,000
    objects) is moved out of the garbage collector's sight before the first test. Each
    test that destroys groups collects garbage (``_dist_helpers.destroy_groups`` says why),
    and a full collection walked all of them: about 0.1 s a test on each rank. Nothing
    frozen is a process group or holds one (only the world exists yet)."""
    gc.freeze()
    yield


@pytest.fixture(scope="module", autouse=True)
def _groups_of_the_module():
    """What a test module's caches hold (``_dist_helpers.module_cache``), and the process
    groups made for them, end with the module."""
    from _dist_helpers import destroy_groups, forget_module_caches, live_groups

    before = live_groups()
    yield
    dist.barrier()
    forget_module_caches()
    destroy_groups(live_groups() - before, keep_module_groups=False)


@pytest.fixture(autouse=True)
def _ranks_in_lockstep():
    """Every test starts and ends with all ranks together and the same RNG state, and
    leaves no process group behind (see ``_dist_helpers.live_groups``)."""
    from _dist_helpers import destroy_groups, live_groups

    torch.manual_seed(1234)
    dist.barrier()
    before = live_groups()
    yield
    dist.barrier()
    destroy_groups(live_groups() - before, keep_module_groups=True)


@pytest.fixture
def world_size():
    return dist.get_world_size()


@pytest.fixture
def rank():
    return dist.get_rank()
