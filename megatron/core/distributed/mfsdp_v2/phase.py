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


class GradPhase(enum.Enum):
    """Where a parameter group's gradients are in a step (``GradientReducer.phase``)."""

    IDLE = enum.auto()  # no accumulation begun: the next reduction starts the step's (reads .grad resets)
    ACCUMULATING = enum.auto()  # earlier microbatches reduced into main_grad; .grad not exposed yet
    REDUCED = enum.auto()  # this backward reduced a microbatch whose result stays internal
    READY = enum.auto()  # this backward reduced what .grad shows at its end (the last microbatch)


# (old, new) pairs of a group's gradients. Any phase may go back to IDLE when an aborted
# backward is discarded (``discard_partial_backward``).
ALLOWED_GRAD_TRANSITIONS = {
    (GradPhase.IDLE, GradPhase.REDUCED),
    (GradPhase.IDLE, GradPhase.READY),
    (GradPhase.ACCUMULATING, GradPhase.REDUCED),
    (GradPhase.ACCUMULATING, GradPhase.READY),
    (GradPhase.REDUCED, GradPhase.ACCUMULATING),  # end of backward: nothing to expose
    (GradPhase.READY, GradPhase.IDLE),  # end of backward: .grad exposed
}


def check_grad_transition(group: str, old: GradPhase, new: GradPhase) -> None:
    """Raise unless ``old -> new`` is an allowed transition of the gradients of ``group``."""
    if (old, new) not in ALLOWED_GRAD_TRANSITIONS:
        raise RuntimeError(
            f"FSDP parameter group {group!r}: invalid gradient transition {old.name} -> {new.name}. "
            "This is an engine bug (or hooks were called by hand); please report it."
        )
