import os
import tempfile

import pytest
import torch.distributed as dist


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank for tests that need collectives or DCP."""
    created = False
    if not dist.is_initialized():
        store_dir = tempfile.mkdtemp(prefix="training_test_store_")
        store = dist.FileStore(os.path.join(store_dir, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        created = True
    yield
    if created:
        dist.destroy_process_group()
