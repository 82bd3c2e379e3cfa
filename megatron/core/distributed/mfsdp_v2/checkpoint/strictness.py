"""What ``load_checkpoint`` does with a tensor that only one side has.

Two cases, each with its own policy: a model tensor the checkpoint lacks (it keeps its
current value, and its parameter its current optimizer state), and a checkpoint tensor the
model lacks (it is not read). A tensor both have but with another shape is always an error.
"""

from __future__ import annotations

import enum
import logging
from typing import Sequence

logger = logging.getLogger(__name__)


class OnMismatch(enum.Enum):
    RAISE = "raise"  # CheckpointMismatchError naming the tensors; nothing is loaded
    LOG = "log"  # one warning from rank 0 naming them, then load the rest
    IGNORE = "ignore"  # load the rest silently


def log_absent(checkpoint_dir: str, absent_from_checkpoint: Sequence[str], absent_from_model: Sequence[str]) -> None:
    """The one warning line of the LOG policies (call it on one rank)."""
    parts = []
    if absent_from_checkpoint:
        parts.append("model tensors the checkpoint lacks keep their current values: "
                     + ", ".join(repr(n) for n in absent_from_checkpoint))
        # The optimizer state of such a parameter stays as it is (none: it starts fresh).
    if absent_from_model:
        parts.append("checkpoint tensors the model lacks are not read: "
                     + ", ".join(repr(n) for n in absent_from_model))
    if parts:
        logger.warning("loading %s: %s", checkpoint_dir, "; ".join(parts))
