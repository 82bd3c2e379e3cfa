"""Benchmark-only variants of the engine, installed on one context at a time, so a variant
and the stock engine run side by side in one interleaved run (contender
``mfsdp_zero3+inflight0`` next to ``mfsdp_zero3``). ``apply(names)`` installs them on the
classes instead (profile_step.py).

inflight0, inflight2
    ``FsdpContext.max_reductions_in_flight`` = 0 or 2 instead of the engine's 1: each
    reduction in flight keeps its input (the unit's gradients in gathered layout) alive,
    so fewer in flight lowers the backward's peak memory and overlaps less communication
    with compute.
no_fwd_prefetch
    Not an optimization: no forward prefetch, to measure what it costs in peak memory and
    saves in time.

Prototypes that the engine has adopted since are gone from this file; measure an
adopted change against the engine before it with a revision contender instead
(``mfsdp_zero3@<rev>``, engine_snapshot.py). The earlier prototypes and their figures:
``results/engine_e0004f2/`` and the README's optimization table.
"""

from __future__ import annotations

import types

CONTEXT_SETTINGS = {
    "inflight0": {"max_reductions_in_flight": 0},
    "inflight2": {"max_reductions_in_flight": 2},
}


def _no_prefetch(self, unit) -> None:
    return None


CONTEXT_PATCHES = {"no_fwd_prefetch": {"prefetch_forward": _no_prefetch}}


def _check(names) -> None:
    known = sorted(CONTEXT_SETTINGS) + sorted(CONTEXT_PATCHES)
    for name in names:
        if name not in known:
            raise ValueError(f"unknown prototype {name!r}; known: {known}")


def apply_to_context(ctx, names) -> None:
    """Install the variants on one context (instance attributes)."""
    _check(names)
    for name in names:
        for attr, value in CONTEXT_SETTINGS.get(name, {}).items():
            setattr(ctx, attr, value)
        for method, fn in CONTEXT_PATCHES.get(name, {}).items():
            setattr(ctx, method, types.MethodType(fn, ctx))


def apply(names) -> None:
    """Install the variants on the engine's classes (every context in the process)."""
    from megatron.core.distributed.mfsdp_v2 import context as ctx_mod

    _check(names)
    for name in names:
        for attr, value in CONTEXT_SETTINGS.get(name, {}).items():
            setattr(ctx_mod, "MAX_REDUCTIONS_IN_FLIGHT", value)
        for method, fn in CONTEXT_PATCHES.get(name, {}).items():
            setattr(ctx_mod.FsdpContext, method, fn)
