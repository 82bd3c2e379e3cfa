"""One parameter group per (dtype, requires_grad) of an FSDP unit, and its buffers.

| buffer          | lies as                       | dtype             | role                                   |
|-----------------|-------------------------------|-------------------|----------------------------------------|
| main_weight     | optimizer placement           | main_params_dtype | what the optimizer updates             |
| model_weight    | parameter placement           | compute dtype     | all-gather input; aliases main_weight  |
| unsharded       | Replicate (gathered layout)   | compute dtype     | exists only between unshard/reshard    |
| main_grad       | gradient placement            | main_grads_dtype  | persistent, allocated eagerly          |
| reduced_grad    | optimizer placement           | main_grads_dtype  | what ``.grad`` shows; aliases main_grad|
|                 |                               |                   | unless a last-microbatch reduction     |
|                 |                               |                   | changes its shape (ZeRO-1)             |

All sharded buffers follow one ``FlatLayout`` over the inner (sharding) axis, so a rank's
slice of every tensor is whole rows and a ``Shard(0)`` DTensor view.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import work as comm
from .layout import FlatLayout
from .mixed_precision import ResolvedPrecision
from .placements import Strategy
from .grad_reduction import GradientReduction
from .shard_views import ShardViews


@dataclasses.dataclass(frozen=True)
class CommResources:
    """What a group is given by its context: the device, the two streams, the counter."""

    device: Any  # DeviceHandle
    allgather_stream: Any
    reduce_scatter_stream: Any
    counter: comm.CollectiveCounter


class FsdpParameter:
    """One logical parameter: tied parameters are one entry with several names."""

    def __init__(self, fqns: Tuple[str, ...], slots, original: nn.Parameter, index: int):
        self.fqns = fqns
        # (module, attribute) pairs that hold this parameter, one per name.
        self.slots: List[Tuple[nn.Module, str]] = slots
        self.shape = original.shape
        self.stride = _contiguous_stride(original.shape)
        self.requires_grad = original.requires_grad
        self.index = index  # position in the group's layout
        self.sharded_param: Optional[nn.Parameter] = None
        self.unsharded_param: Optional[nn.Parameter] = None

    def __repr__(self) -> str:
        return f"FsdpParameter({', '.join(self.fqns)}, shape={tuple(self.shape)})"

    def install(self, param: nn.Parameter) -> None:
        for module, name in self.slots:
            module._parameters[name] = param


def _contiguous_stride(shape: torch.Size) -> Tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


def _storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _alloc_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    needed = tensor.numel() * tensor.element_size() + tensor.storage_offset() * tensor.element_size()
    if storage.size() < needed:
        storage.resize_(needed)


class ParameterGroup(ShardViews, GradientReduction):
    """Buffers and collectives for the parameters of one unit that share (dtype, requires_grad)."""

    def __init__(
        self,
        unit_name_hint: str,
        params: Sequence[FsdpParameter],
        originals: Sequence[nn.Parameter],
        mesh: DeviceMesh,
        strategy: Strategy,
        precision: ResolvedPrecision,
        device,
        resources: "CommResources",
        grad_divisor: float,
    ):
        self.fsdp_parameters: List[FsdpParameter] = list(params)
        self.requires_grad = self.fsdp_parameters[0].requires_grad
        self.precision = precision
        self.dtype = precision.compute
        self.mesh = mesh
        self.strategy = strategy
        self.resources = resources
        self.device = resources.device
        # Set by the owning unit: called when one of this group's gradients was accumulated.
        self.on_grad_ready: Callable[["ParameterGroup"], None] = lambda group: None
        # Set by fully_shard_optimizer(precision_aware=True): .grad keeps main_grads_dtype.
        self.precision_aware_grads = False
        self.grad_divisor = grad_divisor
        self.inner_group = mesh.get_group(strategy.inner_dim)
        self.outer_group = mesh.get_group(strategy.outer_dim) if strategy.outer_dim is not None else None
        self.inner_size = dist.get_world_size(self.inner_group)
        self.inner_rank = dist.get_rank(self.inner_group)
        self.outer_size = dist.get_world_size(self.outer_group) if self.outer_group is not None else 1
        sharded = strategy.param_sharded or strategy.grad_sharded or strategy.optim_sharded
        self.layout = FlatLayout([p.shape for p in self.fsdp_parameters], self.inner_size if sharded else 1)
        self.shard_index = self.inner_rank if sharded else 0
        S, G = self.layout.shard_numel, self.layout.gathered_numel
        # HFSDP: this rank's inner shard is split once more over the outer axis, with the
        # same row-aligned layout applied to the pieces that the inner shard holds.
        self.outer_layout: Optional[FlatLayout] = None
        if strategy.outer_optim_sharded:
            local_pieces = self.layout.pieces_by_shard[self.shard_index]
            self._outer_index = {piece.index: j for j, piece in enumerate(local_pieces)}
            self.outer_layout = FlatLayout(
                [
                    torch.Size(()) if self.layout.replicated[pc.index]
                    else torch.Size((pc.row_end - pc.row_start,) + tuple(self.layout.shapes[pc.index][1:]))
                    for pc in local_pieces
                ],
                self.outer_size,
            )
            self.outer_rank = dist.get_rank(self.outer_group)
        optim_numel = (
            self.outer_layout.shard_numel if self.outer_layout is not None else S if strategy.optim_sharded else G
        )

        # main_weight: the optimizer placement.
        self.main_weight = torch.zeros(optim_numel, dtype=precision.main_params, device=device)
        # model_weight: the compute copy in the parameter placement.
        if strategy.param_sharded:
            if precision.model_weight_aliases_main and self.outer_layout is None:
                self.model_weight = self.main_weight
            else:
                self.model_weight = torch.zeros(S, dtype=precision.compute, device=device)
        else:
            self.model_weight = None  # the persistent unsharded buffer plays this role
        # Unsharded compute weights. ZeRO-3: the gathered buffer itself (its storage exists
        # only while unsharded). Replicated parameters: a packed buffer (tensors end to end,
        # no per-shard padding) kept for good, or the main weight itself when nothing is
        # sharded and the dtypes agree.
        if strategy.param_sharded:
            self.unsharded = torch.zeros(G, dtype=precision.compute, device=device)
        elif not strategy.optim_sharded and precision.model_weight_aliases_main:
            self.unsharded = self.main_weight
        else:
            self.unsharded = torch.zeros(self.layout.total_numel, dtype=precision.compute, device=device)
        self._packed_offsets = [0]
        for numel in self.layout.numels:
            self._packed_offsets.append(self._packed_offsets[-1] + numel)
        self._own_unsharded = {}  # index -> contiguous storage for tensors spanning shards
        self._unshard_versions = None

        # Fixed per group, used on every step: computed once.
        S = self.layout.shard_numel
        self._padding_ranges = [
            (s * S + used, S - used)
            for s, used in ((s, self.layout.used_numel(s)) for s in range(self.layout.num_shards))
            if used < S
        ]
        self._num_trainable = sum(1 for p in self.fsdp_parameters if p.requires_grad)
        self._spanning = [p for p in self.fsdp_parameters if not self.layout.is_contiguous_in_gathered(p.index)]

        self._fill_from_originals(originals)
        self._build_parameters()
        if strategy.param_sharded:
            self._release_unsharded()
        self.is_unsharded = not strategy.param_sharded

        # Gradient buffers, allocated eagerly on the reduce-scatter stream.
        self.main_grad: Optional[torch.Tensor] = None
        self.reduced_grad: Optional[torch.Tensor] = None
        if self.requires_grad:
            with self.device.stream(resources.reduce_scatter_stream):
                self.main_grad = torch.zeros(S if strategy.grad_sharded else G, dtype=precision.main_grads, device=device)
                if self.outer_layout is not None or (not strategy.grad_sharded and strategy.optim_sharded):
                    self.reduced_grad = torch.zeros(optim_numel, dtype=precision.main_grads, device=device)
                else:
                    self.reduced_grad = self.main_grad
            # Their zero-fill ran on the reduce-scatter stream; compute writes them too (no_shard, ZeRO-1).
            self.device.current_waits_for(resources.reduce_scatter_stream)
        # Parameters whose next reduction overwrites instead of accumulating.
        self._overwrite = [False] * len(self.fsdp_parameters)
        self._fresh = [False] * len(self.fsdp_parameters)
        self._received = set()
        self._grads_reduced = False  # a reduction reached reduced_grad since .grad was last set
        # Sharded gradients: each unsharded gradient is moved into the reduce-scatter input
        # as soon as autograd has accumulated it, so the unit never holds its gradients and
        # that input at the same time.
        self._stash_grads = self.requires_grad and strategy.grad_sharded
        self._reduce_input: Optional[torch.Tensor] = None
        self._stashed: set = set()
        self._grad_views: Optional[List[DTensor]] = None

    # Construction ---------------------------------------------------------------------
    def _fill_from_originals(self, originals: Sequence[nn.Parameter]) -> None:
        """Copy each original parameter's rows into the main weight (and the compute copies)."""
        with torch.no_grad():
            for p, original in zip(self.fsdp_parameters, originals):
                if original.is_meta:
                    continue  # materialized later by the model's own init (reset_parameters)
                data = original.detach().to(self.main_weight.device)
                self._main_view(p).copy_(self._optimizer_rows(data, p))
                if self.model_weight is not None and self.model_weight is not self.main_weight:
                    self._model_view(p).copy_(self._inner_rows(data, p))
                if not self.strategy.param_sharded and self.unsharded is not self.main_weight:
                    self._unsharded_tensor(p).copy_(data)

    def _build_parameters(self) -> None:
        for p in self.fsdp_parameters:
            p.sharded_param = nn.Parameter(
                self._dtensor(self._main_view(p), p, self._optimizer_placements(p)), requires_grad=p.requires_grad
            )
            p.unsharded_param = nn.Parameter(self._unsharded_tensor(p), requires_grad=p.requires_grad)
            if p.requires_grad:
                p.unsharded_param.register_post_accumulate_grad_hook(self._make_grad_hook(p))

    def _make_grad_hook(self, p: FsdpParameter):
        def hook(param: torch.Tensor) -> None:
            self._received.add(p.index)
            if self._stash_grads:
                self._stash_grad(p)
            self.on_grad_ready(self)

        return hook

    # Memory accounting ------------------------------------------------------------------
    def persistent_bytes(self) -> dict:
        """Bytes this rank keeps between steps, per buffer (unsharded storage excluded for ZeRO-3)."""
        out = {"main_weight": _storage_bytes(self.main_weight)}
        out["model_weight"] = 0
        if self.model_weight is not None and self.model_weight is not self.main_weight:
            out["model_weight"] = _storage_bytes(self.model_weight)
        if not self.strategy.param_sharded and self.unsharded is not self.main_weight:
            out["model_weight"] = _storage_bytes(self.unsharded)
        out["main_grad"] = _storage_bytes(self.main_grad) if self.main_grad is not None else 0
        if self.reduced_grad is not None and self.reduced_grad is not self.main_grad:
            out["main_grad"] += _storage_bytes(self.reduced_grad)
        return out

    # Unshard / reshard ------------------------------------------------------------------
    def unshard(self) -> Optional[comm.CollectiveWork]:
        """Issue the all-gather of the compute weights (ZeRO-3); None when nothing to do."""
        if self.is_unsharded:
            return None
        ctx, device = self.resources, self.device
        stream = ctx.allgather_stream
        # Reuse of freed unsharded memory must wait for the compute that last read it.
        device.stream_waits_for_current(stream)
        # Refilling the unsharded storage is not a mutation autograd should see: the graph
        # saved these tensors at forward and expects the same values at backward.
        self._unshard_versions = self._unsharded_tensors_and_versions()
        with device.stream(stream):
            _alloc_storage(self.unsharded)
            for t in self._own_unsharded.values():
                _alloc_storage(t)
        self.is_unsharded = True
        return comm.all_gather(
            self.unsharded, self.model_weight, self.inner_group,
            device=device, stream=stream, post_ops=[self._copy_out_spanning] if self._spanning else [],
            counter=ctx.counter,
        )

    def _copy_out_spanning(self) -> None:
        """Assemble the tensors whose rows the shard padding splits (all-gather post-op)."""
        for p in self._spanning:
            self.layout.copy_out(self.unsharded, p.index, self._own_unsharded[p.index])

    def _unsharded_tensors_and_versions(self):
        tensors = (self.unsharded,) + tuple(self._own_unsharded.values())
        return tensors, tuple(t._version for t in tensors)

    def begin_init(self) -> None:
        """Give the unsharded parameters storage, without communication (init writes all)."""
        if self.strategy.param_sharded and not self.is_unsharded:
            _alloc_storage(self.unsharded)
            for t in self._own_unsharded.values():
                _alloc_storage(t)
            self.is_unsharded = True

    def end_init(self) -> None:
        """Keep this rank's rows of the freshly initialized unsharded parameters."""
        with torch.no_grad():
            for p in self.fsdp_parameters:
                full = self._unsharded_tensor(p)
                self._main_view(p).copy_(self._optimizer_rows(full, p))
                if self.model_weight is not None and self.model_weight is not self.main_weight:
                    self._model_view(p).copy_(self._inner_rows(full, p))

    def use_unsharded(self) -> None:
        if self._unshard_versions is not None:
            tensors, versions = self._unshard_versions
            torch._C._autograd._unsafe_set_version_counter(tensors, versions)
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

    def _release_unsharded(self) -> None:
        _free_storage(self.unsharded)
        for t in self._own_unsharded.values():
            _free_storage(t)

    # Optimizer step ---------------------------------------------------------------------
    def sync_model_weight_from_main_weight(self) -> None:
        """Refresh the compute weights from main_weight now (upstream's name; waits)."""
        for work in self.sync_model_weight():
            work.wait()

    def sync_model_weight(self) -> List[comm.CollectiveWork]:
        """After the optimizer updated main_weight: refresh the compute weights."""
        works: List[comm.CollectiveWork] = []
        with torch.no_grad():
            if self.outer_layout is not None:  # HFSDP: gather the outer pieces of the inner shard
                source = self.main_weight.to(self.dtype)
                with self.device.stream(self.resources.allgather_stream):
                    gathered = torch.empty(self.outer_layout.gathered_numel, dtype=self.dtype, device=source.device)
                pieces = self.layout.pieces_by_shard[self.shard_index]

                def copy_out_inner() -> None:
                    for j, piece in enumerate(pieces):
                        target = self.model_weight.narrow(0, piece.offset, piece.numel)
                        self.outer_layout.copy_out(gathered, j, target)

                works.append(comm.all_gather(
                    gathered, source, self.outer_group, device=self.device,
                    stream=self.resources.allgather_stream, post_ops=[copy_out_inner], counter=self.resources.counter,
                ))
                return works
            if self.strategy.param_sharded:
                if self.model_weight is not self.main_weight:
                    self.model_weight.copy_(self.main_weight)
                return works
            if self.strategy.optim_sharded:  # ZeRO-1/2: gather the updated shards
                source = self.main_weight.to(self.dtype)
                with self.device.stream(self.resources.allgather_stream):
                    gathered = torch.empty(self.layout.gathered_numel, dtype=self.dtype, device=source.device)

                def copy_out() -> None:
                    for p in self.fsdp_parameters:
                        self.layout.copy_out(gathered, p.index, self._unsharded_tensor(p))

                works.append(comm.all_gather(
                    gathered, source, self.inner_group, device=self.device,
                    stream=self.resources.allgather_stream, post_ops=[copy_out], counter=self.resources.counter,
                ))
            elif self.unsharded is not self.main_weight:
                for p in self.fsdp_parameters:
                    self._unsharded_tensor(p).copy_(self._main_view(p))
        return works

