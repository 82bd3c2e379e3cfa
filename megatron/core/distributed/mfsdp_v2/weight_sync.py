"""After the optimizer step: the compute weights follow the updated main weights.

``WeightSync`` is one part of a ``ParameterGroup``. The optimizer updates ``main_weight``
(optimizer placement); the compute weights (parameter placement) are then refreshed:

    same placement            a local copy where the buffers differ (dtype), else nothing
    inner Shard -> Replicate  ZeRO-1/2: all-gather the updated shards into the replicated
                              compute weights
    outer Shard -> Replicate  HFSDP: all-gather the outer pieces of this rank's inner shard

It is given the group's strategy, compute dtype, layouts, buffers, axes and views
(``shard_views.py``), and issues its collective through ``FlatBuffer.redistribute``.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from megatron.core.torch_private import version_of

from . import work as comm
from .flat_buffer import CommResources, DataParallelAxes, single_axis_steps
from .group_buffers import GroupBuffers
from .layout import FlatLayout
from .shard_views import ShardViews


class WeightSync:
    """Refresh the compute weights from ``main_weight`` after the optimizer step.

    ``fully_shard_optimizer`` refreshes them right after each step. Any other in-place
    update of the parameters (a torch optimizer used without it, a manual ``p.mul_()``
    under ``no_grad``) bumps their version counters: the next unshard sees that and
    refreshes first (``sync_if_main_weight_changed``). No process-wide hook is needed.
    The counters move alike on every rank (every rank steps every parameter; a rank
    without rows of one steps its empty view), so the refresh, a collective for
    ZeRO-1/2 and HFSDP, happens on all ranks or none. Writes into the local tensors
    (``p.to_local().copy_()``, a checkpoint load) do not count: whoever writes there
    refreshes (``load_checkpoint`` does).

    Owns: the version sum of the sharded parameters that the compute weights were last
    refreshed from (``note_in_sync`` records the current one). Built once the group's
    sharded parameters exist; counts them in sync from the start."""

    def __init__(self, params, views: ShardViews, layout: FlatLayout, outer_layout: Optional[FlatLayout],
                 shard_index: int, strategy, dtype: torch.dtype, resources: CommResources,
                 axes: DataParallelAxes, buffers: GroupBuffers):
        self.fsdp_parameters, self.views = params, views
        self.layout, self.outer_layout, self.shard_index = layout, outer_layout, shard_index
        self.strategy, self.dtype, self.axes = strategy, dtype, axes
        self.resources, self.device = resources, resources.device
        self.main_weight, self.model_weight, self.unsharded = buffers.main_weight, buffers.model_weight, buffers.unsharded
        self.note_in_sync()

    def _weights_version(self) -> int:
        return sum(version_of(p.sharded_param) for p in self.fsdp_parameters)

    def note_in_sync(self) -> None:
        """The compute weights now follow the sharded parameters as they are."""
        self._synced_version = self._weights_version()

    def sync_if_main_weight_changed(self) -> None:
        if self._weights_version() != self._synced_version:
            self.sync_model_weight_from_main_weight()

    def sync_model_weight_from_main_weight(self) -> None:
        """Refresh the compute weights from main_weight now (upstream's name; waits)."""
        for work in self.sync_model_weight():
            work.wait()

    def sync_model_weight(self) -> List[comm.CollectiveWork]:
        """After the optimizer updated main_weight: refresh the compute weights (an
        all-gather where the optimizer placement is Shard and the parameter's Replicate)."""
        source, target = self.strategy.optimizer, self.strategy.parameter
        self.note_in_sync()  # the values read below are those of this version
        with torch.no_grad():
            if source == target:  # same rows: a local copy where the buffers differ
                if self.model_weight is not None and self.model_weight is not self.main_weight:
                    self.model_weight.copy_(self.main_weight)
                elif self.model_weight is None and self.unsharded is not self.main_weight:
                    for p in self.fsdp_parameters:
                        self.views.unsharded_tensor(p).copy_(self.views.main_view(p))
                return []
            (axis, _, _), = single_axis_steps(source, target)  # decode_strategy allows no more
            stream = self.resources.allgather_stream
            wire = self.axes.flat(self.main_weight.to(self.dtype), source)
            outer = axis == 0 and self.axes.outer_group is not None
            layout = self.outer_layout if outer else self.layout
            with self.device.stream(stream):
                gathered = torch.empty(layout.gathered_numel, dtype=self.dtype, device=wire.data.device)
            if outer:  # HFSDP: gather the outer pieces of this rank's inner shard
                pieces = self.layout.pieces_by_shard[self.shard_index]

                def copy_out() -> None:
                    for j, piece in enumerate(pieces):
                        self.outer_layout.copy_out(gathered, j, self.model_weight.narrow(0, piece.offset, piece.numel))
            else:  # ZeRO-1/2: gather the updated shards into the replicated compute weights

                def copy_out() -> None:
                    for p in self.fsdp_parameters:
                        self.layout.copy_out(gathered, p.index, self.views.unsharded_tensor(p))

            return [wire.redistribute(wire.like(gathered, target), self.resources, stream, post_ops=[copy_out])]
