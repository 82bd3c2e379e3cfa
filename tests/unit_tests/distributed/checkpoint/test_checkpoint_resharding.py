"""save_checkpoint / load_checkpoint: bit-exact round trips and resharding.

Run at 1, 2 and 4 ranks::

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m pytest tests/unit_tests/distributed/checkpoint

A model is trained a few steps under ZeRO-3 over the whole world and saved; the full
tensors of its weights and optimizer state are rebuilt independently (own all-gather).
Each target layout -- another world size (a subgroup), another strategy, a plain model in
one process -- loads the checkpoint and must hold exactly the rows the engine would give
it from those full tensors, for weights and optimizer state alike.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed.mfsdp_v2 import MixedPrecisionPolicy, fully_shard_optimizer, load_checkpoint, save_checkpoint
from megatron.core.distributed.mfsdp_v2.checkpoint.manifest import read_manifest

from _dist_helpers import mesh_1d, mesh_2d, owners, rank, world, wrap
from _ckpt_helpers import (
    Odd,
    adamw,
    assert_loaded,
    full_state_zero3,
    gpt,
    gpt_batch,
    gpt_loss,
    gpt_units,
    remove_tmpdir,
    shared_tmpdir,
    subgroup,
    train,
)

MODELS = {
    "gpt": (lambda seed, dtype=torch.float32: gpt("gpt", dtype, seed), gpt_units, gpt_batch, gpt_loss),
    "llama": (lambda seed, dtype=torch.float32: gpt("llama", dtype, seed), gpt_units, gpt_batch, gpt_loss),
    "odd": (lambda seed, dtype=torch.float32: _seeded(Odd, seed, dtype), lambda m: m.units(),
            lambda g, rows: torch.randn(rows, 5, generator=g), lambda m, x: m(x.to(m.tiny.weight.dtype)).float().pow(2).mean()),
}


def _seeded(cls, seed, dtype):
    torch.manual_seed(seed)
    return cls(dtype)


@pytest.fixture(scope="module", params=sorted(MODELS))
def saved(request):
    """A model trained 2 steps under ZeRO-3 at the full world size, saved; with ground truth."""
    build, units, batch, loss = MODELS[request.param]
    model = build(0)
    ctx = wrap(model, units(model), mesh_1d(), "zero3")
    optimizer = fully_shard_optimizer(adamw(model.parameters()))
    train(model, ctx, optimizer, batch, loss, steps=2, seed=1, dp_rank=rank(), dp_size=world())
    path = shared_tmpdir()
    save_checkpoint(model, optimizer, path)
    params, state = full_state_zero3(model, ctx, optimizer)
    yield request.param, path, params, state
    remove_tmpdir(path)


def _fresh(name, seed=7):
    build, units, batch, loss = MODELS[name]
    return build(seed), units


def test_manifest_describes_every_tensor_with_its_global_shape(saved):
    name, path, params, state = saved
    manifest = read_manifest(path)
    tensors = manifest["dcp"]["tensors"]
    for fqn, full in params.items():
        entry = tensors["model." + fqn]
        assert tuple(entry["shape"]) == tuple(full.shape) and entry["dtype"] == "float32"
        covered = sum(torch.Size(c["sizes"]).numel() for c in entry["chunks"])
        assert covered == full.numel(), f"{fqn}: chunks cover {covered} of {full.numel()} elements"
    assert manifest["world_size"] == world()
    assert manifest["optimizer"]["class"] == "AdamW"


def test_plain_model_in_one_process(saved):
    """Saved by all ranks under ZeRO-3, loaded by rank 0 alone into an unwrapped model."""
    name, path, params, state = saved
    if rank() == 0:
        model, _ = _fresh(name)
        optimizer = adamw(model.parameters())
        load_checkpoint(model, optimizer, path)
        for fqn, p in model.named_parameters():
            assert torch.equal(p.detach(), params[fqn]), fqn
            for key, value in state[fqn].items():
                assert torch.equal(optimizer.state[p][key], value), f"{fqn}.{key}"
        assert optimizer.param_groups[0]["lr"] == 0.01


@pytest.mark.parametrize("strategy", ["zero3", "zero2", "zero1", "no_shard"])
def test_same_world_other_strategy(saved, strategy):
    name, path, params, state = saved
    model, units = _fresh(name)
    ctx = wrap(model, units(model), mesh_1d(), strategy)
    optimizer = fully_shard_optimizer(adamw(model.parameters()))
    load_checkpoint(model, optimizer, path)
    assert_loaded(model, ctx, optimizer, params, state)


@pytest.mark.parametrize("strategy", ["zero3", "zero1"])
def test_half_the_ranks(saved, strategy):
    """ZeRO-3 at N -> ZeRO-3 / ZeRO-1 at N/2 (at N=1: the same single rank)."""
    name, path, params, state = saved
    members = list(range(max(1, world() // 2)))
    with subgroup(members) as group:
        if group is not None:
            model, units = _fresh(name)
            ctx = wrap(model, units(model), mesh_1d(group), strategy)
            optimizer = fully_shard_optimizer(adamw(model.parameters()))
            load_checkpoint(model, optimizer, path)
            assert_loaded(model, ctx, optimizer, params, state)
            if strategy == "zero1":  # the replicated compute weights were refreshed from the loaded rows
                own = owners(ctx)
                for fqn, p in model.named_parameters():
                    _, unit_group, fp = own[id(p)]
                    assert torch.equal(unit_group.views.unsharded_tensor(fp), params[fqn]), fqn


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_two_dimensional_mesh(saved, strategy):
    # 2x2 at 4 ranks; at 2 ranks a (2, 1) mesh still loads into outer replicas.
    outer = min(2, world())
    name, path, params, state = saved
    model, units = _fresh(name)
    ctx = wrap(model, units(model), mesh_2d((outer, world() // outer)), strategy)
    optimizer = fully_shard_optimizer(adamw(model.parameters()))
    load_checkpoint(model, optimizer, path)
    assert_loaded(model, ctx, optimizer, params, state)


def test_resumed_training_equals_uninterrupted():
    """Train 2, save, train 2 more == fresh model + load + train the same 2 (bitwise)."""
    build, units, batch, loss = MODELS["gpt"]
    model = build(0)
    ctx = wrap(model, units(model), mesh_1d(), "zero3")
    optimizer = fully_shard_optimizer(adamw(model.parameters()))
    train(model, ctx, optimizer, batch, loss, 2, seed=1, dp_rank=rank(), dp_size=world())
    path = shared_tmpdir()
    save_checkpoint(model, optimizer, path)
    expected = train(model, ctx, optimizer, batch, loss, 2, seed=2, dp_rank=rank(), dp_size=world())

    resumed = build(5)
    ctx2 = wrap(resumed, units(resumed), mesh_1d(), "zero3")
    optimizer2 = fully_shard_optimizer(adamw(resumed.parameters()))
    load_checkpoint(resumed, optimizer2, path)
    got = train(resumed, ctx2, optimizer2, batch, loss, 2, seed=2, dp_rank=rank(), dp_size=world())
    assert torch.equal(torch.stack(got), torch.stack(expected))
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), n
    remove_tmpdir(path)


@pytest.mark.parametrize("strategy", ["zero3", "zero1", "no_shard"])
def test_bf16_compute_round_trip_is_bit_exact(strategy):
    """bf16 compute, fp32 main weights: the checkpoint holds the fp32 main weights; a reload
    restores them and the bf16 compute weights exactly."""
    policy = MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    build, units, batch, loss = MODELS["llama"]
    model = build(0, torch.bfloat16)
    ctx = wrap(model, units(model), mesh_1d(), strategy, policy)
    optimizer = fully_shard_optimizer(adamw(model.parameters()))
    train(model, ctx, optimizer, batch, loss, 2, seed=1, dp_rank=rank(), dp_size=world())
    path = shared_tmpdir()
    save_checkpoint(model, optimizer, path)
    manifest = read_manifest(path)
    assert all(t["dtype"] == "float32" for k, t in manifest["dcp"]["tensors"].items() if k.startswith("model."))

    other = build(3, torch.bfloat16)
    ctx2 = wrap(other, units(other), mesh_1d(), strategy, policy)
    optimizer2 = fully_shard_optimizer(adamw(other.parameters()))
    load_checkpoint(other, optimizer2, path)
    groups = [g for u in ctx.units for g in u.parameter_groups]
    groups2 = [g for u in ctx2.units for g in u.parameter_groups]
    for g, g2 in zip(groups, groups2):
        assert torch.equal(g.main_weight, g2.main_weight)
        compute, compute2 = (g.model_weight, g2.model_weight) if g.model_weight is not None else (g.unsharded, g2.unsharded)
        assert compute2.dtype == torch.bfloat16 and torch.equal(compute, compute2)
    # And both continue identically.
    a = train(model, ctx, optimizer, batch, loss, 1, seed=4, dp_rank=rank(), dp_size=world())
    b = train(other, ctx2, optimizer2, batch, loss, 1, seed=4, dp_rank=rank(), dp_size=world())
    assert torch.equal(a[0], b[0])
    remove_tmpdir(path)


def test_replicated_plain_model_and_mfsdp_share_the_format():
    """A plain model replicated on every rank (DDP's layout) saved with the world group loads
    into ZeRO-3, and a ZeRO-3 checkpoint loads back into the replicated model on every rank."""
    build, units, batch, loss = MODELS["gpt"]
    plain = build(0)
    optimizer = adamw(plain.parameters())
    train(plain, None, optimizer, batch, loss, 2, seed=1, dp_rank=0, dp_size=1)  # same data on every rank
    path = shared_tmpdir()
    save_checkpoint(plain, optimizer, path, process_group=dist.group.WORLD)
    sharded = build(4)
    ctx = wrap(sharded, units(sharded), mesh_1d(), "zero3")
    sharded_optimizer = fully_shard_optimizer(adamw(sharded.parameters()))
    load_checkpoint(sharded, sharded_optimizer, path)
    full = {n: p.detach() for n, p in plain.named_parameters()}
    state = {n: dict(optimizer.state[p]) for n, p in plain.named_parameters()}
    assert_loaded(sharded, ctx, sharded_optimizer, full, state)

    back_path = shared_tmpdir()
    save_checkpoint(sharded, sharded_optimizer, back_path)
    replica = build(8)
    replica_optimizer = adamw(replica.parameters())
    load_checkpoint(replica, replica_optimizer, back_path, process_group=dist.group.WORLD)
    for (n, a), b in zip(plain.named_parameters(), replica.parameters()):
        assert torch.equal(a, b), n
        assert torch.equal(optimizer.state[a]["exp_avg_sq"], replica_optimizer.state[b]["exp_avg_sq"]), n
    remove_tmpdir(path)
    remove_tmpdir(back_path)
