"""Benchmark-only variants of the engine, installed on one context at a time, so a variant
and the stock engine run side by side in one interleaved run (contender
``mfsdp_zero3+inflight0`` next to ``mfsdp_zero3``).

inflight0, inflight2
    ``FsdpContext.max_reductions_in_flight`` = 0 or 2 instead of the engine's 1: each
    reduction in flight keeps its input (the unit's gradients in gathered layout) alive,
    so fewer in flight lowers the backward's peak memory and overlaps less communication
    with compute.
no_fwd_prefetch
    Not an optimization: no forward prefetch, to measure what it costs in peak memory and
    saves in time.

Only the context's public surface is used (the ``max_reductions_in_flight`` property and
the ``prefetch_forward(state)`` method, replaced on the instance). Measure an adopted
change against the engine before it with a revision contender instead
(``mfsdp_zero3@<rev>``, engine_snapshot.py).
"""

from __future__ import annotations

CONTEXT_SETTINGS = {
    "inflight0": {"max_reductions_in_flight": 0},
    "inflight2": {"max_reductions_in_flight": 2},
}


def _no_prefetch(state) -> None:
    return None


CONTEXT_METHODS = {"no_fwd_prefetch": {"prefetch_forward": _no_prefetch}}


def _check(names) -> None:
    known = sorted(CONTEXT_SETTINGS) + sorted(CONTEXT_METHODS)
    for name in names:
        if name not in known:
            raise ValueError(f"unknown prototype {name!r}; known: {known}")


def apply_to_context(ctx, names) -> None:
    """Install the variants on one context (its public settings; methods as instance attributes)."""
    _check(names)
    if not isinstance(getattr(type(ctx), "max_reductions_in_flight", None), property):
        raise ValueError("prototypes need an engine whose FsdpContext has the max_reductions_in_flight "
                         "property and prefetch_forward(state); use them on the working tree's engine.")
    for name in names:
        for attr, value in CONTEXT_SETTINGS.get(name, {}).items():
            setattr(ctx, attr, value)
        for method, fn in CONTEXT_METHODS.get(name, {}).items():
            setattr(ctx, method, fn)
