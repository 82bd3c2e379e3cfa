"""Global grad-norm clipping equals torch.nn.utils.clip_grad_norm_ on unsharded gradients."""

import math
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.core.optimizer import clip_grad_norm, get_grad_norm

SHAPES = [(5, 3), (7,), (4, 4), (1,), (9, 2)]  # odd first dims: uneven shards over 2 ranks


def make_params(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in SHAPES:
        p = torch.nn.Parameter(torch.randn(shape, generator=g, dtype=torch.float64))
        p.grad = torch.randn(shape, generator=g, dtype=torch.float64) * scale
        params.append(p)
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_plain_tensors_match_torch(norm_type, max_norm):
    ours, ref = make_params(), make_params()
    total = clip_grad_norm(ours, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
    torch.testing.assert_close(total.double(), expected.double(), rtol=1e-6, atol=0)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-12)


def test_clip_zero_only_measures():
    params = make_params(scale=10.0)
    before = [p.grad.clone() for p in params]
    total = clip_grad_norm(params, 0.0)
    assert total.item() > 1.0
    for p, b in zip(params, before):
        assert torch.equal(p.grad, b)


def test_non_finite_norm_leaves_gradients_untouched():
    params = make_params()
    params[1].grad[0] = float("nan")
    before = [p.grad.clone() for p in params]
    total = clip_grad_norm(params, 1.0)
    assert not torch.isfinite(total)
    for p, b in zip(params, before):
        assert torch.equal(p.grad.nan_to_num(7.0), b.nan_to_num(7.0))


def test_parameters_without_grad_are_ignored_and_empty_is_zero():
    params = make_params()
    params[0].grad = None
    ref = make_params()[1:]
    torch.testing.assert_close(
        get_grad_norm(params).double(), torch.nn.utils.get_total_norm([p.grad for p in ref]).double()
    )
    assert get_grad_norm([]).item() == 0.0


# --- sharded DTensor gradients on 2 ranks -------------------------------------------------

def _sharded_worker(rank, world_size, store_path, out_dir):
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    _sharded_norms(rank, world_size, out_dir)
    dist.barrier()
    # A finished worker leaves at once, its gloo group not torn down: the group's destructor
    # joins gloo's work thread while holding the GIL, which that thread may be waiting for
    # (a deadlock seen in CI), and gloo's threads may outlive the group into the interpreter's
    # teardown and abort it (megatron/training/shutdown.py). The results are on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _sharded_norms(rank, world_size, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    results = {}
    mesh1 = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    mesh2 = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("outer", "inner"))
    layouts = {
        "zero3": lambda i: (mesh1, [Shard(0)]),
        "mixed": lambda i: [(mesh1, [Shard(0)]), (mesh1, [Replicate()]), None][i % 3],
        "hsdp": lambda i: (mesh2, [Replicate(), Shard(0)]),
    }
    for name, layout in layouts.items():
        for norm_type in (2.0, math.inf):
            params = make_params(seed=1, scale=3.0)
            sharded = []
            for i, p in enumerate(params):
                spec = layout(i)
                if spec is None:  # a plain (replicated, e.g. DDP) tensor
                    sharded.append(p)
                    continue
                mesh, placements = spec
                dp = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, placements))
                dp.grad = distribute_tensor(p.grad, mesh, placements)
                sharded.append(dp)
            total = clip_grad_norm(sharded, 1.0, norm_type)
            full = [
                (g.full_tensor() if hasattr(g, "full_tensor") else g)
                for g in (p.grad for p in sharded)
            ]
            results[(name, norm_type)] = (total.item(), full)
    torch.save(results, os.path.join(out_dir, f"result_{rank}.pt"))


def test_sharded_dtensor_gradients_match_unsharded_reference():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_sharded_worker, args=(2, os.path.join(tmp, "store"), tmp), nprocs=2, join=True)
        results = [torch.load(os.path.join(tmp, f"result_{r}.pt"), weights_only=False) for r in range(2)]
    for key in results[0]:
        _, norm_type = key
        ref = make_params(seed=1, scale=3.0)
        expected = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type)
        for rank in range(2):
            total, grads = results[rank][key]
            assert total == pytest.approx(expected.item(), rel=1e-9), (key, rank)
            for g, p in zip(grads, ref):
                torch.testing.assert_close(g, p.grad, rtol=1e-9, atol=1e-12, msg=f"{key} rank {rank}")
