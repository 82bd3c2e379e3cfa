"""Every private name of torch this project relies on, and the one place that reaches it.

torch offers no public way to do these things; each entry says what for. When a torch
release moves or changes one of them, ``tests/unit_tests/distributed/test_torch_private.py``
(run in CI on torch 2.13 and on the newest torch the project supports) fails naming it,
instead of a training run misbehaving somewhere downstream. Nothing here assigns to torch:
these are reads and calls only.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch
import torch.distributed._functional_collectives as functional_collectives
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

__all__ = [
    "DTensorSpec", "StridedShard", "TensorMeta", "TorchDispatchMode", "contiguous_strides",
    "current_graph_task_id", "dtensor_local", "dtensor_spec", "flatten_mesh", "functional_collectives",
    "in_backward", "profiler_enabled", "set_nested_element", "storage_info", "set_version_counters", "sharding_propagator",
    "tree_flatten", "tree_leaves", "tree_unflatten", "unwrap_to_op_info", "version_of",
]

# Also re-exported from here: torch's pytree (tree_flatten / tree_unflatten / tree_leaves: a
# hook's outputs, a dispatched operator's arguments), TorchDispatchMode (the stream checker,
# test machinery) and the functional collectives (RowShard's gather and reduce-scatter over
# one mesh dim, which DTensor's redistribute calls in turn).

# The metadata of one DTensor (mesh, placements, global shape/stride/dtype) and its tensor
# part: RowShardedTensor builds DTensors whose placements torch cannot describe from them.
StridedShard = _StridedShard  # a Shard placement torch's strategies may produce (FSDP2 + TP)


def dtensor_spec(t: DTensor) -> DTensorSpec:
    return t._spec


def dtensor_local(t: DTensor) -> torch.Tensor:
    """The local tensor itself (not ``to_local()``'s autograd view): what a
    ``__torch_dispatch__`` works on."""
    return t._local_tensor


def contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    return tuple(torch._prims_common.make_contiguous_strides_for(shape))


def sharding_propagator():
    """torch's DTensor sharding propagator, asked (read only) how it would run an operator."""
    return DTensor._op_dispatcher.sharding_propagator


def unwrap_to_op_info(func, args: tuple, kwargs: dict):
    return DTensor._op_dispatcher.unwrap_to_op_info(func, args, kwargs)


def current_graph_task_id() -> int:
    """The autograd engine's id of the graph being executed; -1 outside a backward."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """Whether this code runs inside a backward pass (an activation recompute's forward);
    torch's own checkpoint reads the graph-task id the same way."""
    return current_graph_task_id() != -1


def version_of(t: torch.Tensor) -> int:
    """``t``'s version counter (bumped by every in-place write autograd can see)."""
    return t._version


def profiler_enabled() -> bool:
    """Whether a torch profiler is recording (the engine's ranges cost nothing otherwise)."""
    return torch.autograd._profiler_enabled()


def set_version_counters(tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
    """Put back the version counters of ``tensors``: the engine's all-gather writes the
    unsharded storage that autograd saw before, which is not a user's in-place change."""
    torch._C._autograd._unsafe_set_version_counter(tuple(tensors), tuple(versions))


def flatten_mesh(mesh, name: str):
    """A 1-D mesh over all of ``mesh``'s ranks (DeviceMesh has no public flatten in 2.13)."""
    return mesh._flatten(name)


def storage_info(**fields):
    """DCP's index entry for one stored chunk (the checkpoint index read back from our JSON)."""
    # Import cost: torch.distributed.checkpoint adds most of a second; only checkpoints need it.
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(**fields)


def set_nested_element(root: dict, path, value) -> None:
    """DCP's setter of a value at a flattened state-dict path (its planner's own mapping)."""
    # Import cost, as above.
    from torch.distributed.checkpoint._nested_dict import set_element

    set_element(root, path, value)
