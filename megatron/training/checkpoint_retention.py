"""--save-retain-interval N: keep every N-th checkpoint, delete the others once a newer
one is complete.

Upstream's rule: when a save is committed (renamed into place and tracked), the
checkpoint the tracker named before is deleted unless its iteration is a multiple of N.
The deletion only ever touches a checkpoint older than the tracked, complete one, so a
process killed at any point still has the latest good checkpoint. A checkpoint being
deleted is first renamed to ``iter_XXXXXXX.del`` (atomic), so a kill in the middle of the
deletion leaves no half-deleted directory under a loadable name; the next pruning
removes such leftovers.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import List, Optional

from megatron.training.log_utils import print_rank_0

_ITER_DIR = re.compile(r"^iter_(\d{7})$")
DELETING_SUFFIX = ".del"


def check_retain_interval(retain: Optional[int], save: Optional[str], save_interval: Optional[int]) -> None:
    """Parse-time checks (ValueError with what to do)."""
    if retain is None:
        return
    if retain <= 0:
        raise ValueError(f"--save-retain-interval must be positive, got {retain}.")
    if not save:
        raise ValueError("--save-retain-interval needs --save DIR (the checkpoints it prunes).")
    if save_interval is not None and retain % save_interval:
        raise ValueError(f"--save-retain-interval ({retain}) must be a multiple of --save-interval ({save_interval}) "
                         f"so that the kept iterations are saved ones; use {max(1, retain // save_interval) * save_interval}.")


def prune_after_commit(root: str, previous: Optional[int], latest: int, retain: Optional[int]) -> List[int]:
    """Rank 0, after ``latest`` is complete and tracked: delete ``previous`` (the iteration
    tracked before) unless it is kept; returns the deleted iterations."""
    _remove_leftovers(root)
    if retain is None or previous is None or previous == latest or previous % retain == 0:
        return []
    path = os.path.join(root, f"iter_{previous:07d}")
    if not os.path.isdir(path) or os.path.islink(path):
        return []  # a link points at a checkpoint someone else keeps (as upstream)
    doomed = path + DELETING_SUFFIX
    try:
        os.replace(path, doomed)
    except OSError as e:  # the new checkpoint is saved; a failed clean-up must not fail the run
        print_rank_0(f"> WARNING: could not delete the checkpoint at iteration {previous} ({e}); delete {path} yourself")
        return []
    shutil.rmtree(doomed, ignore_errors=True)
    print_rank_0(f"> deleted checkpoint at iteration {previous} (--save-retain-interval {retain} keeps "
                 f"multiples of {retain} and the latest, {latest})")
    return [previous]


def _remove_leftovers(root: str) -> None:
    for name in os.listdir(root):
        if name.endswith(DELETING_SUFFIX) and _ITER_DIR.match(name[:-len(DELETING_SUFFIX)]):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
