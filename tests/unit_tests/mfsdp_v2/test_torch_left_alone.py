"""The project uses torch and never patches it: importing every module of ``megatron`` and
training a sharded model (the lazy paths too: DTensor operators on uneven row shards, a
redistribution, a checkpoint-style state_dict) leaves every attribute of torch's DTensor,
autograd, optimizer and module machinery the object it was. And the placements the engine
defines answer ``!=`` as ``not ==``."""

import itertools
import subprocess
import sys
import textwrap

from torch.distributed.tensor import Partial, Replicate, Shard

from megatron.core.distributed.mfsdp_v2.row_shard import NestedRowShard, RowShard

_PROBE = textwrap.dedent('''
    import importlib, os, pkgutil, sys, types
    import torch, torch.distributed as dist
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import _dtensor_spec, placement_types

    WATCHED_MODULES = [importlib.import_module(name) for name in (
        "torch", "torch.nn.functional", "torch.distributed.tensor", "torch.distributed.tensor._api",
        "torch.distributed.tensor._dispatch", "torch.distributed.tensor._redistribute",
        "torch.distributed.tensor._sharding_prop", "torch.distributed.tensor._dtensor_spec",
        "torch.distributed.tensor.placement_types", "torch.distributed.checkpoint", "torch.optim.optimizer",
        "torch.nn.modules.module", "torch.distributed", "torch.autograd", "torch.utils.checkpoint")]
    # torch rebinds some of its own names when these load (torch._dynamo wraps
    # torch.manual_seed): load them first, so that what changes afterwards is ours.
    import torch._dynamo  # noqa: F401
    WATCHED_CLASSES = [torch.Tensor, torch.nn.Module, torch.nn.Parameter, torch.UntypedStorage, dt.DTensor,
                       torch.optim.Optimizer, placement_types.Shard, placement_types.Replicate,
                       placement_types.Partial, _dtensor_spec.DTensorSpec, type(dt.DTensor._op_dispatcher),
                       type(dt.DTensor._op_dispatcher.sharding_propagator)]
    OBJECTS = [dt.DTensor._op_dispatcher, dt.DTensor._op_dispatcher.sharding_propagator]

    def snapshot():
        seen = {}
        for m in WATCHED_MODULES:
            for k, v in list(vars(m).items()):
                if not isinstance(v, types.ModuleType):
                    seen[(m.__name__, k)] = id(v)
        for c in WATCHED_CLASSES:
            for k, v in list(vars(c).items()):
                seen[(c.__qualname__, k)] = id(v)
        for o in OBJECTS:
            for k, v in list(vars(o).items()):
                seen[(type(o).__name__ + "()", k)] = id(v)
        return seen

    before = snapshot()
    keep = [v for v in before]  # ids stay meaningful: nothing watched is collected
    import megatron
    for info in pkgutil.walk_packages(megatron.__path__, "megatron."):
        try:
            importlib.import_module(info.name)
        except ImportError as error:  # optional extras (transformer-engine, apex, ...)
            print("skipped import", info.name, error, file=sys.stderr)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PROBE_PORT"], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from megatron.core.distributed.mfsdp_v2 import Placements, fully_shard, fully_shard_context, fully_shard_optimizer
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    model = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    with fully_shard_context(device="cpu"):
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh, placements=Placements.zero3())
    opt = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    for p in model.parameters():
        (p * 2).full_tensor(); p.redistribute(p.device_mesh, [dt.Replicate()])
    model.state_dict(); opt.state_dict()
    dist.destroy_process_group()
    after = snapshot()
    changed = sorted(str(k) for k in before if k in after and before[k] != after[k])
    added = sorted(str(k) for k in after if k not in before and not k[1].startswith("_abc"))
    print("CHANGED", changed)
    print("ADDED", added)
''')


def test_importing_and_training_replaces_no_torch_attribute(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "PROBE_PORT": str(port)})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith(("CHANGED", "ADDED")))
    assert lines["CHANGED"] == "[]", f"torch attributes replaced: {lines['CHANGED']}"
    assert lines["ADDED"] == "[]", f"attributes added to torch: {lines['ADDED']}"


def _placements():
    return [
        Shard(0), Shard(1), Replicate(), Partial(), Partial("avg"),
        RowShard([2, 2]), RowShard([3, 1]), RowShard([3, 1]), RowShard([4, 0]), RowShard([2, 2, 0]),
        RowShard([1]), NestedRowShard(), NestedRowShard(2, 0), NestedRowShard(2, 2),
    ]


def test_not_equal_is_not_equal_for_every_placement_pair():
    for a, b in itertools.product(_placements(), repeat=2):
        assert (a != b) is (not (a == b)), f"{a!r} != {b!r} disagrees with =="
        if a == b:
            assert hash(a) == hash(b), f"{a!r} == {b!r} but their hashes differ"


def test_row_shards_equal_torch_shard_only_for_torch_split():
    assert RowShard([2, 2]) == Shard(0) and Shard(0) == RowShard([2, 2])  # torch.chunk's own split
    assert RowShard([3, 1]) != Shard(0) and Shard(0) != RowShard([3, 1])
    assert RowShard([3, 1]) != RowShard([1, 3]) and RowShard([3, 1]) == RowShard([3, 1])
    assert NestedRowShard(2, 0) != Shard(0) and NestedRowShard(2, 0) != NestedRowShard(2, 2)
