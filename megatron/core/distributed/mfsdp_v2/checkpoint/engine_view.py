"""The checkpoint package's only window into the engine.

Every read of engine internals (contexts, units, parameter groups, FsdpParameter, the
layouts, unit state) and every engine action a save or load needs happens in this file,
so that a change of the engine's internals is answered here alone. The rest of the
package sees contexts as opaque handles and parameters as ``ShardedRows``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

import torch
import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class ShardedRows:
    """An engine-managed parameter: its global ``shape`` and the global dim-0 rows
    ``[row_start, row_end)`` this rank holds of it in the optimizer placement (the main
    weights and optimizer state). A 0-d parameter is ``(0, 1)``."""

    shape: torch.Size
    row_start: int
    row_end: int


def contexts_of(model: nn.Module) -> List[Any]:
    """The FSDP contexts managing any parameter of ``model``, in parameter order (empty
    for a plain model). Reads the ``_mfsdp_context`` attribute that ``fully_shard`` sets
    on every sharded parameter."""
    contexts = []
    for p in model.parameters():
        ctx = getattr(p, "_mfsdp_context", None)
        if ctx is not None and all(ctx is not c for c in contexts):
            contexts.append(ctx)
    return contexts


def sharded_parameters(contexts) -> Dict[int, ShardedRows]:
    """``{id(parameter): ShardedRows}`` of every parameter the contexts manage."""
    found: Dict[int, ShardedRows] = {}
    for ctx in contexts:
        for unit in ctx.units:
            for group in unit.parameter_groups:
                for fp in group.fsdp_parameters:
                    start, end = group.views.optimizer_row_range(fp)
                    found[id(fp.sharded_param)] = ShardedRows(torch.Size(fp.shape), start, end)
    return found


def local_rows(tensor) -> torch.Tensor:
    """This rank's rows of an engine-managed parameter or of optimizer state laid out like
    it (the rows ``ShardedRows`` names): the live storage, which a load writes into."""
    return tensor.to_local().detach()


def unit_meshes(contexts) -> List[Any]:
    """The device mesh of every unit, in registration order."""
    return [unit.fsdp_state.mesh for ctx in contexts for unit in ctx.units]


def unit_strategies(contexts) -> Dict[str, str]:
    """``{unit name ("<root>" for a root): strategy name}`` for the manifest."""
    out = {}
    for ctx in contexts:
        for unit in ctx.units:
            out[unit.name or "<root>"] = unit.fsdp_state.strategy.name
    return out


def reshard_all(contexts) -> None:
    """Bring every unit to its resting (sharded) state; raises if a context's scope is
    still open."""
    for ctx in contexts:
        ctx.check_finalized()
        ctx.reshard_all()


def sync_compute_weights(contexts) -> None:
    """Refresh every unit's compute weights from its main weights (after writing them)."""
    works = []
    for ctx in contexts:
        for unit in ctx.units:
            for group in unit.parameter_groups:
                works.extend(group.sync_model_weight())
    for work in works:
        work.wait()


def step_at_zero_lr(optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step (the caller set lr 0 and zero gradients). The engine's step hook
    refreshes the compute weights from unchanged main weights, which changes nothing; the
    load refreshes them again after it wrote the main weights."""
    optimizer.step()
