"""One parameter group per (dtype, requires_grad) of an FSDP unit: the facade the unit
drives (unshard, reshard, reduce_grads, sync after the optimizer step).

The group is composed of objects that each own their state, built here with explicit inputs:

    ShardViews       shard_views.py     where each parameter's rows live; views into the
                                        buffers; DTensor placements
    GradientReducer  grad_reduction.py  GradPhase and this backward's gradients, the
                                        gradient hook, reduce_grads, expose_grads
    WeightSync       weight_sync.py     the compute weights follow main_weight after a step

The buffers and their placements are in ``group_buffers.py``; every collective is a
``FlatBuffer.redistribute`` between those placements (``flat_buffer.py``). All sharded
buffers follow one ``FlatLayout`` over the inner (sharding) axis, so a rank's slice of
every tensor is whole rows. The group itself owns whether the compute weights are
unsharded now and the version snapshot of an unshard in flight (``VersionSnapshot``).
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from megatron.core.torch_private import set_version_counters, version_of

from . import work as comm
from .flat_buffer import CommResources, DataParallelAxes, alloc_storage, free_storage
from .fsdp_parameter import FsdpParameter
from .grad_reduction import GradientReducer
from .group_buffers import allocate_buffers, persistent_bytes
from .layout import FlatLayout
from .mixed_precision import ResolvedPrecision
from .placements import Strategy
from .shard_views import OuterSplit, ShardViews
from .weight_sync import WeightSync

__all__ = ["CommResources", "FsdpParameter", "ParameterGroup", "VersionSnapshot"]


class VersionSnapshot:
    """The autograd version counters of some tensors, taken before a write that autograd
    must not see and put back after it (``restore``).

    Not a context manager: the write is the all-gather that refills the unsharded storage,
    issued by ``unshard()`` and finished (the collective and its post-ops) whenever the unit
    waits for it, outside any ``with`` block here; the counters go back when the unit starts
    using the refilled tensors (``use_unsharded()``)."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self._tensors = tuple(tensors)
        self._versions = tuple(version_of(t) for t in self._tensors)

    def restore(self) -> None:
        set_version_counters(self._tensors, self._versions)


class ParameterGroup:
    """Buffers and collectives for the parameters of one unit that share (dtype, requires_grad).

    Owns: the parameters, their layout and buffers, ``is_unsharded`` and the version
    snapshot of an unshard in flight; ``views``, ``grads`` and ``weights`` own the rest."""

    def __init__(self, unit_name_hint: str, params: Sequence[FsdpParameter], originals: Sequence[nn.Parameter],
                 mesh: DeviceMesh, strategy: Strategy, precision: ResolvedPrecision, device,
                 resources: CommResources, grad_divisor: float):
        self.fsdp_parameters: List[FsdpParameter] = list(params)
        self.requires_grad = self.fsdp_parameters[0].requires_grad
        self.precision, self.dtype = precision, precision.compute
        self.mesh, self.strategy = mesh, strategy
        self.resources, self.device = resources, resources.device
        self.grad_divisor = grad_divisor
        self.axes = DataParallelAxes.of(mesh, strategy)
        self.inner_group = self.axes.inner_group
        sharded = "S" in strategy.parameter + strategy.gradient + strategy.optimizer
        self.layout = FlatLayout([p.shape for p in self.fsdp_parameters], self.axes.inner_size if sharded else 1)
        self.shard_index = self.axes.inner_rank if sharded else 0
        outer = (OuterSplit.of(self.layout, self.shard_index, self.axes.outer_size, self.axes.outer_rank)
                 if strategy.outer_optim_sharded else None)
        self.outer_layout: Optional[FlatLayout] = outer.layout if outer is not None else None
        buffers = allocate_buffers(self.layout, self.outer_layout, strategy, precision, device, resources,
                                   self.requires_grad)
        self.main_weight, self.model_weight, self.unsharded = buffers.main_weight, buffers.model_weight, buffers.unsharded
        self.main_grad, self.reduced_grad = buffers.main_grad, buffers.reduced_grad
        self.views = ShardViews(self.layout, self.shard_index, outer, strategy, mesh, buffers,
                                two_axes=self.axes.outer_group is not None)
        self._fill_from_originals(originals)
        self.grads = GradientReducer(self.fsdp_parameters, self.layout, self.shard_index, self.outer_layout,
                                     strategy, precision, resources, self.axes, grad_divisor, buffers, self.views,
                                     self.requires_grad)
        self._build_parameters()
        if strategy.param_sharded:
            self._release_unsharded()
        self.is_unsharded = not strategy.param_sharded
        self._refill_versions: Optional[VersionSnapshot] = None  # taken at unshard, restored at use
        self.weights = WeightSync(self.fsdp_parameters, self.views, self.layout, self.outer_layout, self.shard_index,
                                  strategy, self.dtype, resources, self.axes, buffers)

    def persistent_bytes(self) -> dict:
        return persistent_bytes(self)

    # Settings the unit and the optimizer give the gradient reducer ------------------------
    @property
    def on_grad_ready(self) -> Callable[[], None]:
        """Called when one of this group's gradients was accumulated (set by the owning unit)."""
        return self.grads.on_grad_ready

    @on_grad_ready.setter
    def on_grad_ready(self, callback: Callable[[], None]) -> None:
        self.grads.on_grad_ready = callback

    @property
    def precision_aware_grads(self) -> bool:
        """Set by fully_shard_optimizer(precision_aware=True): .grad keeps main_grads_dtype."""
        return self.grads.precision_aware_grads

    @precision_aware_grads.setter
    def precision_aware_grads(self, value: bool) -> None:
        self.grads.precision_aware_grads = value

    # Construction ---------------------------------------------------------------------
    def _fill_from_originals(self, originals: Sequence[nn.Parameter]) -> None:
        """Copy each original parameter's rows into the main weight (and the compute copies)."""
        with torch.no_grad():
            for p, original in zip(self.fsdp_parameters, originals):
                if not original.is_meta:  # meta: materialized later by init_parameters
                    self.views.write_rows(p, original.detach().to(self.main_weight.device), unsharded=True)

    def _build_parameters(self) -> None:
        views = self.views
        for p in self.fsdp_parameters:
            p.sharded_param = nn.Parameter(
                views.dtensor(views.main_view(p), p, views.optimizer_placements(p)), requires_grad=p.requires_grad
            )
            p.unsharded_param = nn.Parameter(views.unsharded_tensor(p), requires_grad=p.requires_grad)
            if p.requires_grad:
                p.unsharded_param.register_post_accumulate_grad_hook(self.grads.make_grad_hook(p))
                if self.strategy.grad_sharded:  # the gradient has a reduce-scatter input to land in
                    # Read by fused linear layers (megatron.core.tensor_parallel.grad_accumulation_fusion).
                    p.unsharded_param.fused_wgrad_out = functools.partial(self.grads.fused_wgrad_out, p)
                    p.unsharded_param.add_to_fused_wgrad = functools.partial(self.grads.add_to_fused_wgrad, p)

    def begin_init(self) -> None:
        """Give the unsharded parameters storage, without communication (init writes all)."""
        if self.strategy.param_sharded and not self.is_unsharded:
            self._alloc_unsharded()
            self.is_unsharded = True

    def end_init(self) -> None:
        """Keep this rank's rows of the freshly initialized unsharded parameters."""
        with torch.no_grad():
            for p in self.fsdp_parameters:
                self.views.write_rows(p, self.views.unsharded_tensor(p), unsharded=False)
        self.weights.note_in_sync()

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
        self._refill_versions = VersionSnapshot(self.views.unsharded_storages())
        with self.device.stream(stream):
            self._alloc_unsharded()
        self.is_unsharded = True
        weights = self.axes.flat(self.model_weight, self.strategy.parameter)
        return weights.redistribute(weights.like(self.unsharded, "R" * len(self.axes.groups)), self.resources, stream,
                                    post_ops=self.views.gather_post_ops())

    def use_unsharded(self) -> None:
        if self._refill_versions is not None:
            self._refill_versions.restore()
            self._refill_versions = None
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
        for t in self.views.unsharded_storages():
            alloc_storage(t, self.device)

    def _release_unsharded(self) -> None:
        for t in self.views.unsharded_storages():
            free_storage(t, self.device)

    # Gradients (grad_reduction.py) ---------------------------------------------------------
    def reduce_grads(self, is_last_microbatch: bool) -> List[comm.CollectiveWork]:
        """Reduce this backward's gradients into main_grad (missing gradients count as zero)."""
        return self.grads.reduce_grads(is_last_microbatch)

    def expose_grads(self) -> None:
        """Point each parameter's ``.grad`` at its reduced gradient (end of backward)."""
        self.grads.expose_grads()

    def all_grads_received(self) -> bool:
        return self.grads.all_grads_received()

    def discard_partial_backward(self) -> None:
        """Forget gradients of an aborted backward that were never reduced."""
        self.grads.discard_partial_backward()

    # Compute weights after the optimizer step (weight_sync.py) -----------------------------
    def sync_model_weight(self) -> List[comm.CollectiveWork]:
        """Refresh the compute weights from main_weight (an all-gather where needed)."""
        return self.weights.sync_model_weight()

    def sync_model_weight_from_main_weight(self) -> None:
        """Refresh the compute weights from main_weight now (upstream's name; waits)."""
        self.weights.sync_model_weight_from_main_weight()

    def sync_if_main_weight_changed(self) -> None:
        self.weights.sync_if_main_weight_changed()
