"""megatron/core/torch_private.py: each private name of torch the project relies on still
exists and still does what the project uses it for. CI runs this on torch 2.13 and on the
newest torch (the 2-rank stage on MEGATRON_NEXT_TORCH): when torch moves or changes one,
this fails naming it. And no module of megatron/ reaches torch's private names elsewhere."""

import os
import re

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from megatron.core import torch_private as tp

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))


def _mesh():
    return DeviceMesh("cpu", torch.arange(dist.get_world_size()))


def test_dtensor_internals():
    world = dist.get_world_size()
    full = torch.arange(4.0 * world).reshape(2 * world, 2)
    t = distribute_tensor(full, _mesh(), [Shard(0)])
    spec = tp.dtensor_spec(t)
    assert isinstance(spec, tp.DTensorSpec) and spec.placements == t.placements
    assert spec.tensor_meta.shape == full.shape
    assert tp.dtensor_local(t).data_ptr() == t.to_local().data_ptr()
    assert tp.contiguous_strides((2, 3, 4)) == (12, 4, 1)
    meta = tp.TensorMeta(torch.Size((2 * world, 2)), tp.contiguous_strides((2 * world, 2)), torch.float32)
    rebuilt = DTensor(tp.dtensor_local(t), tp.DTensorSpec(t.device_mesh, (Shard(0),), tensor_meta=meta),
                      requires_grad=False)
    assert torch.equal(rebuilt.full_tensor(), full)
    strided = tp.StridedShard(0, split_factor=2)  # a dim-0 split the engine treats as sharded
    assert (strided.dim, strided.split_factor) == (0, 2)


def test_sharding_propagator_is_asked_read_only():
    world = dist.get_world_size()
    a = distribute_tensor(torch.ones(2 * world, 3), _mesh(), [Shard(0)])
    b = distribute_tensor(torch.ones(2 * world, 3), _mesh(), [Replicate()])
    op_info = tp.unwrap_to_op_info(torch.ops.aten.add.Tensor, (a, b), {})
    tp.sharding_propagator().propagate(op_info)
    assert op_info.output_sharding.output_spec.placements == (Shard(0),)
    assert hasattr(op_info.output_sharding, "needs_redistribute") and hasattr(op_info, "schema")


def test_graph_task_id_and_version_counters():
    seen = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append((tp.current_graph_task_id(), tp.in_backward())) or g)
    y.sum().backward()
    assert tp.current_graph_task_id() == -1 and not tp.in_backward()
    assert seen and seen[0][0] != -1 and seen[0][1]
    t = torch.zeros(3)
    before = tp.version_of(t)
    t.add_(1)
    assert tp.version_of(t) == before + 1
    tp.set_version_counters([t], [before])
    assert tp.version_of(t) == before


def test_flatten_mesh_and_functional_collectives():
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(world, 1), mesh_dim_names=("a", "b"))
    flat = tp.flatten_mesh(mesh, "ab_flat")
    assert flat.size() == world and dist.get_world_size(flat.get_group()) == world
    me = float(dist.get_rank())
    gathered = tp.functional_collectives.all_gather_single(torch.full((1,), me), 0, (mesh, 0))
    assert tp.functional_collectives.wait_tensor(gathered).tolist() == [float(r) for r in range(world)]
    summed = tp.functional_collectives.reduce_scatter_single(torch.ones(world), "sum", 0, (mesh, 0))
    assert tp.functional_collectives.wait_tensor(summed).tolist() == [float(world)]


def test_pytree_dispatch_mode_profiler_and_dcp_helpers():
    leaves, spec = tp.tree_flatten({"a": [1, 2], "b": (3,)})
    assert tp.tree_unflatten(leaves, spec) == {"a": [1, 2], "b": (3,)}
    assert tp.tree_leaves(([1], {"x": 2})) == [1, 2]

    class Seen(tp.TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in Seen.ops
    assert not tp.profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert tp.profiler_enabled()
    info = tp.storage_info(relative_path="f.distcp", offset=3, length=5, transform_descriptors=None)
    assert (info.relative_path, info.offset, info.length) == ("f.distcp", 3, 5)
    root = {"a": {"b": 1}}
    tp.set_nested_element(root, ("a", "b"), 2)
    assert root == {"a": {"b": 2}}


# torch's private names as the project's code would spell them; torch_private.py alone may.
_PRIVATE = re.compile(r"torch\._C\b|torch\._prims_common|torch\.utils\._|torch\.distributed\.tensor\._"
                      r"|torch\.distributed\.checkpoint\._|torch\.distributed\._functional|_op_dispatcher"
                      r"|\._spec\b|\._local_tensor\b|_profiler_enabled|\._flatten\(|_unsafe_set_version_counter"
                      r"|_current_graph_task_id|from torch[\w.]* import [^#]*\b_[A-Za-z]|\._version\b")


def test_no_private_torch_name_outside_the_adapter():
    found = []
    for folder, _, files in os.walk(os.path.join(REPO, "megatron")):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path.endswith(os.path.join("core", "torch_private.py")):
                continue
            for number, line in enumerate(open(path), 1):
                code = line.split("#", 1)[0]
                if _PRIVATE.search(code):
                    found.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()}")
    assert not found, "torch private names outside megatron/core/torch_private.py:\n" + "\n".join(found)
