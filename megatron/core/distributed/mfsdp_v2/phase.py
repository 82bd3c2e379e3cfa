"""The lifecycle of an FSDP unit: ``FsdpModule.Phase`` and the transitions its hooks may take."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """Where a unit is in its step (``FsdpModule.Phase``)."""

    RESTING = enum.auto()  # between steps (a root may still hold its forward's weights)
    FORWARD = enum.auto()  # between pre_forward and post_forward
    BACKWARD = enum.auto()  # between pre_backward and post_backward; recomputation runs inside it
    POST_BACKWARD = enum.auto()  # this backward reduced its gradients (or it has none to reduce)


# (old, new) pairs the hooks may take. Reaching RESTING at the end of a backward
# (finished or aborted) goes through UnitState.rest(), from any phase.
ALLOWED_TRANSITIONS = {
    (Phase.RESTING, Phase.FORWARD),
    (Phase.FORWARD, Phase.RESTING),
    (Phase.RESTING, Phase.BACKWARD),
    (Phase.BACKWARD, Phase.POST_BACKWARD),
    # Gradients that arrive, or are settled as unused, without a pre-backward hook
    # (no output of the unit required grad).
    (Phase.RESTING, Phase.POST_BACKWARD),
}


def check_transition(unit: str, old: Phase, new: Phase) -> None:
    """Raise unless ``old -> new`` is an allowed transition of unit ``unit``."""
    if (old, new) not in ALLOWED_TRANSITIONS:
        raise RuntimeError(
            f"FSDP unit {unit!r}: invalid phase transition {old.name} -> {new.name}. "
            "This is an engine bug (or hooks were called by hand); please report it."
        )
