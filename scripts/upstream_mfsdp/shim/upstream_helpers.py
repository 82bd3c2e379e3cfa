"""Our stand-in for the test helper upstream's checkpoint test imports."""

import os
import pathlib
import shutil

import torch.distributed as dist


class TempNamedDir:
    """A directory at a given path, shared by all ranks, emptied on entry and removed on exit.

    Rank 0 creates and removes it. With ``sync=True`` the ranks meet at a barrier after
    creation and before removal, so no rank sees it half made or already gone.
    """

    def __init__(self, path, sync=True):
        self.path = pathlib.Path(path)
        self.sync = sync

    def __enter__(self):
        if dist.get_rank() == 0:
            shutil.rmtree(self.path, ignore_errors=True)
            os.makedirs(self.path)
        if self.sync:
            dist.barrier()
        return self.path

    def __exit__(self, *exc_info):
        if self.sync:
            dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(self.path, ignore_errors=True)
        return False
