"""One parameter group per (dtype, requires_grad) of an FSDP unit: the facade the unit
drives (unshard, reshard, reduce_grads, sync after the optimizer step).

The buffers and their placements are in ``group_buffers.py``; every collective is a
``FlatBuffer.redistribute`` between those placements (``flat_buffer.py``); where each
parameter's rows live is ``shard_views.py``; the gradient path is ``grad_reduction.py``;
the refresh of the compute weights after the optimizer step is ``weight_sync.py``.
All sharded buffers follow one ``FlatLayout`` over the inner (sharding) axis, so a rank's
slice of every tensor is whole rows.
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from megatron.core.torch_private import set_version_counters, version_of

from . import work as comm
from .flat_buffer import CommResources, FlatBuffer, alloc_storage, free_storage
from .fsdp_parameter import FsdpParameter
from .grad_reduction import GradientReduction
from .group_buffers import allocate_buffers, persistent_bytes
from .layout import FlatLayout
from .mixed_precision import ResolvedPrecision
from .placements import Strategy
from .shard_views import ShardViews
from .weight_sync import WeightSync

__all__ = ["CommResources", "FsdpParameter", "ParameterGroup"]


class ParameterGroup(ShardViews, GradientReduction, WeightSync):
    """Buffers and collectives for the parameters of one unit that share (dtype, requires_grad)."""

    def __init__(self, unit_name_hint: str, params: Sequence[FsdpParameter], originals: Sequence[nn.Parameter],
                 mesh: DeviceMesh, strategy: Strategy, precision: ResolvedPrecision, device,
                 resources: CommResources, grad_divisor: float):
        self.fsdp_parameters: List[FsdpParameter] = list(params)
        self.requires_grad = self.fsdp_parameters[0].requires_grad
        self.precision, self.dtype = precision, precision.compute
        self.mesh, self.strategy = mesh, strategy
        self.resources, self.device = resources, resources.device
        # Set by the owning unit: called when one of this group's gradients was accumulated.
        self.on_grad_ready: Callable[["ParameterGroup"], None] = lambda group: None
        # Set by fully_shard_optimizer(precision_aware=True): .grad keeps main_grads_dtype.
        self.precision_aware_grads = False
        self.grad_divisor = grad_divisor
        self.inner_group = mesh.get_group(strategy.inner_dim)
        self.outer_group = mesh.get_group(strategy.outer_dim) if strategy.outer_dim is not None else None
        # The process group of each placement axis, outer first (as the strategy's codes).
        self.axis_groups = tuple(g for g in (self.outer_group, self.inner_group) if g is not None)
        self.inner_size, self.inner_rank = dist.get_world_size(self.inner_group), dist.get_rank(self.inner_group)
        self.outer_size = dist.get_world_size(self.outer_group) if self.outer_group is not None else 1
        sharded = "S" in strategy.parameter + strategy.gradient + strategy.optimizer
        self.layout = FlatLayout([p.shape for p in self.fsdp_parameters], self.inner_size if sharded else 1)
        self.shard_index = self.inner_rank if sharded else 0
        # HFSDP: this rank's inner shard is split once more over the outer axis, with the
        # same row-aligned layout applied to the pieces that the inner shard holds.
        self.outer_layout: Optional[FlatLayout] = None
        if strategy.outer_optim_sharded:
            local_pieces = self.layout.pieces_by_shard[self.shard_index]
            self._outer_index = {piece.index: j for j, piece in enumerate(local_pieces)}
            self.outer_layout = FlatLayout([
                torch.Size(()) if self.layout.replicated[pc.index]
                else torch.Size((pc.row_end - pc.row_start,) + tuple(self.layout.shapes[pc.index][1:]))
                for pc in local_pieces
            ], self.outer_size)
            self.outer_rank = dist.get_rank(self.outer_group)
        buffers = allocate_buffers(self.layout, self.outer_layout, strategy, precision, device, resources,
                                   self.requires_grad)
        self.main_weight, self.model_weight, self.unsharded = buffers.main_weight, buffers.model_weight, buffers.unsharded
        self.main_grad, self.reduced_grad = buffers.main_grad, buffers.reduced_grad
        self._packed_offsets = [0]
        for numel in self.layout.numels:
            self._packed_offsets.append(self._packed_offsets[-1] + numel)
        self._own_unsharded = {}  # index -> contiguous storage for tensors spanning shards
        self._unshard_versions = None
        self._spanning = [p for p in self.fsdp_parameters if not self.layout.is_contiguous_in_gathered(p.index)]
        self._fill_from_originals(originals)
        self._build_parameters()
        if strategy.param_sharded:
            self._release_unsharded()
        self.is_unsharded = not strategy.param_sharded
        self._init_gradient_state()
        self._note_weights_in_sync()

    def flat(self, data: torch.Tensor, codes: str) -> FlatBuffer:
        """``data`` as a flat buffer with placement ``codes`` on this group's axes."""
        return FlatBuffer(data, codes, self.axis_groups)

    def persistent_bytes(self) -> dict:
        return persistent_bytes(self)

    # Construction ---------------------------------------------------------------------
    def _fill_from_originals(self, originals: Sequence[nn.Parameter]) -> None:
        """Copy each original parameter's rows into the main weight (and the compute copies)."""
        with torch.no_grad():
            for p, original in zip(self.fsdp_parameters, originals):
                if not original.is_meta:  # meta: materialized later by init_parameters
                    self._keep_own_rows(p, original.detach().to(self.main_weight.device), unsharded=True)

    def _keep_own_rows(self, p: FsdpParameter, full: torch.Tensor, unsharded: bool) -> None:
        self._main_view(p).copy_(self._optimizer_rows(full, p))
        if self.model_weight is not None and self.model_weight is not self.main_weight:
            self._model_view(p).copy_(self._inner_rows(full, p))
        if unsharded and not self.strategy.param_sharded and self.unsharded is not self.main_weight:
            self._unsharded_tensor(p).copy_(full)

    def _build_parameters(self) -> None:
        for p in self.fsdp_parameters:
            p.sharded_param = nn.Parameter(
                self._dtensor(self._main_view(p), p, self._optimizer_placements(p)), requires_grad=p.requires_grad
            )
            p.unsharded_param = nn.Parameter(self._unsharded_tensor(p), requires_grad=p.requires_grad)
            if p.requires_grad:
                p.unsharded_param.register_post_accumulate_grad_hook(self._make_grad_hook(p))
                if self.strategy.grad_sharded:  # the gradient has a reduce-scatter input to land in
                    # Read by fused linear layers (megatron.core.tensor_parallel.grad_accumulation_fusion).
                    p.unsharded_param.fused_wgrad_out = functools.partial(self.fused_wgrad_out, p)
                    p.unsharded_param.add_to_fused_wgrad = functools.partial(self.add_to_fused_wgrad, p)

    def begin_init(self) -> None:
        """Give the unsharded parameters storage, without communication (init writes all)."""
        if self.strategy.param_sharded and not self.is_unsharded:
            self._alloc_unsharded()
            self.is_unsharded = True

    def end_init(self) -> None:
        """Keep this rank's rows of the freshly initialized unsharded parameters."""
        with torch.no_grad():
            for p in self.fsdp_parameters:
                self._keep_own_rows(p, self._unsharded_tensor(p), unsharded=False)
        self._note_weights_in_sync()

    # Unshard / reshard: parameter placement -> Replicate -------------------------------
    def unshard(self) -> Optional[comm.CollectiveWork]:
        """Issue the all-gather of the compute weights (ZeRO-3); None when nothing to do."""
        if self.is_unsharded:
            return None
        stream = self.resources.allgather_stream
        # Reuse of freed unsharded memory must wait for the compute that last read it.
        self.device.stream_waits_for_current(stream)
        # Refilling the unsharded storage is not a mutation autograd should see: the graph
        # saved these tensors at forward and expects the same values at backward.
        tensors = (self.unsharded,) + tuple(self._own_unsharded.values())
        self._unshard_versions = tensors, tuple(version_of(t) for t in tensors)
        with self.device.stream(stream):
            self._alloc_unsharded()
        self.is_unsharded = True
        weights = self.flat(self.model_weight, self.strategy.parameter)
        return weights.redistribute(weights.like(self.unsharded, "R" * len(self.axis_groups)), self.resources, stream,
                                    post_ops=[self._copy_out_spanning] if self._spanning else [])

    def _copy_out_spanning(self) -> None:
        """Assemble the tensors whose rows the shard padding splits (all-gather post-op)."""
        for p in self._spanning:
            self.layout.copy_out(self.unsharded, p.index, self._own_unsharded[p.index])

    def use_unsharded(self) -> None:
        if self._unshard_versions is not None:
            tensors, versions = self._unshard_versions
            set_version_counters(tensors, versions)
            self._unshard_versions = None
        for p in self.fsdp_parameters:
            p.install(p.unsharded_param)

    def use_sharded(self) -> None:
        for p in self.fsdp_parameters:
            p.install(p.sharded_param)

    def reshard(self) -> None:
        self.use_sharded()
        if self.strategy.param_sharded and self.is_unsharded:
            self._release_unsharded()
            self.is_unsharded = False

    def _alloc_unsharded(self) -> None:
        for t in (self.unsharded, *self._own_unsharded.values()):
            alloc_storage(t, self.device)

    def _release_unsharded(self) -> None:
        for t in (self.unsharded, *self._own_unsharded.values()):
            free_storage(t, self.device)
