"""Checkpoint errors are raised on every rank, before anything is modified; uneven shards
are described with their true offsets; asynchronous saves."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from megatron.core.distributed.mfsdp_v2 import fully_shard_optimizer, load_checkpoint, save_checkpoint
from megatron.core.distributed.mfsdp_v2.checkpoint.errors import CheckpointError, CheckpointMismatchError
from megatron.core.distributed.mfsdp_v2.checkpoint.manifest import MANIFEST_NAME, read_manifest

from _dist_helpers import mesh_1d, owners, rank, world, wrap
from _ckpt_helpers import (
    Odd,
    adamw,
    full_state_zero3,
    gpt,
    gpt_batch,
    gpt_loss,
    gpt_units,
    remove_tmpdir,
    shared_tmpdir,
    train,
)


def _saved_gpt():
    model = gpt("gpt", seed=0)
    ctx = wrap(model, gpt_units(model), mesh_1d(), "zero3")
    optimizer = fully_shard_optimizer(adamw(model.parameters()))
    train(model, ctx, optimizer, gpt_batch, gpt_loss, 1, seed=1, dp_rank=rank(), dp_size=world())
    path = shared_tmpdir()
    save_checkpoint(model, optimizer, path)
    return model, ctx, optimizer, path


def _snapshot(model, optimizer):
    params = {n: p.to_local().clone() for n, p in model.named_parameters()}
    state = {id(p): {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in s.items()}
             for p, s in optimizer.state.items()}
    return params, state


def _unchanged(model, optimizer, snapshot):
    params, state = snapshot
    for n, p in model.named_parameters():
        assert torch.equal(p.to_local(), params[n]), f"{n} was modified by a failed load"
    assert {id(p) for p in optimizer.state} == set(state)
    for p, s in optimizer.state.items():
        for k, v in s.items():
            assert torch.equal((v.to_local() if hasattr(v, "to_local") else v), state[id(p)][k])


@pytest.fixture(scope="module")
def saved():
    model, ctx, optimizer, path = _saved_gpt()
    yield path
    remove_tmpdir(path)


def test_uneven_shards_are_described_with_their_true_rows():
    """The rows each rank writes are the engine's, not torch's even chunks (which differ here)."""
    torch.manual_seed(0)
    model = Odd()
    ctx = wrap(model, model.units(), mesh_1d(), "zero3")
    path = shared_tmpdir()
    save_checkpoint(model, None, path)
    chunks = read_manifest(path)["dcp"]["tensors"]
    own = owners(ctx)
    differs = False
    for name, p in model.named_parameters():
        _, group, fp = own[id(p)]
        if len(fp.shape) == 0:
            continue
        mine = group.layout.local_piece(fp.index, group.shard_index)[:2]
        saved_rows = {(c["offsets"][0], c["offsets"][0] + c["sizes"][0]) for c in chunks["model." + name]["chunks"]}
        if mine[1] > mine[0]:
            assert tuple(mine) in saved_rows, (name, mine, saved_rows)
        even_size, even_offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        differs |= (even_offset[0], even_offset[0] + even_size[0]) != tuple(mine)
    flags = [None] * world()
    dist.all_gather_object(flags, differs)
    if world() > 1:
        assert any(flags), "test model too regular: torch's even split would coincide with the engine's"
    # And a full reload in one process gives back exactly the weights.
    full, _ = full_state_zero3(model, ctx, torch.optim.SGD(model.parameters(), lr=0.1))
    if rank() == 0:
        torch.manual_seed(3)
        plain = Odd()
        load_checkpoint(plain, None, path)
        for name, p in plain.named_parameters():
            assert torch.equal(p.detach(), full[name]), name
        assert torch.equal(plain.offset, torch.arange(3, dtype=torch.float32))
    remove_tmpdir(path)


def test_shape_mismatch_names_the_tensor_on_every_rank_and_changes_nothing(saved):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(1)
    config = TransformerConfig(num_layers=2, hidden_size=12, num_attention_heads=3, ffn_hidden_size=24)
    model = GPTModel(config, 37, 6)
    wrap(model, gpt_units(model), mesh_1d(), "zero3")
    optimizer = fully_shard_optimizer(adamw(model.parameters()))
    snapshot = _snapshot(model, optimizer)
    with pytest.raises(CheckpointMismatchError, match=r"linear_fc1.bias' has shape \(48,\) in the checkpoint but \(24,\)"):
        load_checkpoint(model, optimizer, saved)
    _unchanged(model, optimizer, snapshot)


def test_missing_and_unexpected_tensors_are_listed(saved):
    torch.manual_seed(1)
    model = gpt("llama", seed=1)
    wrap(model, gpt_units(model), mesh_1d(), "zero3")
    with pytest.raises(CheckpointMismatchError, match="lacks: 'output_layer.weight'.*lacks: 'decoder.final_layernorm.bias'"):
        load_checkpoint(model, None, saved)


def test_optimizer_class_mismatch(saved):
    model = gpt("gpt", seed=1)
    wrap(model, gpt_units(model), mesh_1d(), "zero3")
    optimizer = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(CheckpointMismatchError, match="holds AdamW state but the optimizer is SGD"):
        load_checkpoint(model, optimizer, saved)
    assert not optimizer.state


def test_corrupt_file_is_named_on_every_rank_and_changes_nothing():
    model, ctx, optimizer, path = _saved_gpt()
    snapshot = _snapshot(model, optimizer)
    data_files = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    victim = os.path.join(path, data_files[-1])
    dist.barrier()
    if rank() == 0:
        blob = bytearray(open(victim, "rb").read())
        blob[len(blob) // 2] ^= 0x10
        open(victim, "wb").write(bytes(blob))
    dist.barrier()
    with pytest.raises(CheckpointError, match=f"{data_files[-1]} is corrupt"):
        load_checkpoint(model, optimizer, path)
    _unchanged(model, optimizer, snapshot)
    dist.barrier()
    if rank() == 0:
        with open(victim, "r+b") as f:
            f.truncate(100)
    dist.barrier()
    with pytest.raises(CheckpointError, match=f"{data_files[-1]} has 100 bytes"):
        load_checkpoint(model, optimizer, path)
    dist.barrier()
    if rank() == 0:
        manifest = os.path.join(path, MANIFEST_NAME)
        text = open(manifest).read()
        open(manifest, "w").write(text.replace('"world_size"', '"world_sizf"'))
    dist.barrier()
    with pytest.raises(CheckpointError, match=f"{MANIFEST_NAME} is corrupt"):
        load_checkpoint(model, optimizer, path)
    dist.barrier()
    if rank() == 0:
        os.remove(os.path.join(path, MANIFEST_NAME))
    dist.barrier()
    with pytest.raises(CheckpointError, match="not a complete MFSDP checkpoint"):
        load_checkpoint(model, optimizer, path)
    _unchanged(model, optimizer, snapshot)
    remove_tmpdir(path)


def test_existing_checkpoint_is_not_overwritten_silently(saved):
    model = gpt("gpt", seed=1)
    wrap(model, gpt_units(model), mesh_1d(), "zero3")
    with pytest.raises(ValueError, match="already holds a checkpoint; pass overwrite=True"):
        save_checkpoint(model, None, saved)


def test_model_only_load_and_missing_optimizer_state(saved):
    model = gpt("gpt", seed=1)
    wrap(model, gpt_units(model), mesh_1d(), "zero3")
    load_checkpoint(model, None, saved)
    path = shared_tmpdir()
    save_checkpoint(model, None, path)
    optimizer = fully_shard_optimizer(adamw(model.parameters()))
    with pytest.raises(CheckpointMismatchError, match="holds no optimizer state"):
        load_checkpoint(model, optimizer, path)
    remove_tmpdir(path)


def test_async_save_writes_a_consistent_snapshot():
    """The checkpoint holds the state at the time of the call, although training goes on."""
    model = gpt("gpt", seed=0)
    ctx = wrap(model, gpt_units(model), mesh_1d(), "zero3")
    optimizer = fully_shard_optimizer(adamw(model.parameters()))
    train(model, ctx, optimizer, gpt_batch, gpt_loss, 1, seed=1, dp_rank=rank(), dp_size=world())
    expected, expected_state = full_state_zero3(model, ctx, optimizer)
    path = shared_tmpdir()
    group = dist.new_group(backend="gloo")
    future = save_checkpoint(model, optimizer, path, process_group=group, async_save=True)
    train(model, ctx, optimizer, gpt_batch, gpt_loss, 2, seed=2, dp_rank=rank(), dp_size=world())
    assert future.result(timeout=60) == path
    dist.barrier()
    if rank() == 0:
        plain = gpt("gpt", seed=9)
        plain_optimizer = adamw(plain.parameters())
        load_checkpoint(plain, plain_optimizer, path)
        for name, p in plain.named_parameters():
            assert torch.equal(p.detach(), expected[name]), name
            assert torch.equal(plain_optimizer.state[p]["exp_avg"], expected_state[name]["exp_avg"]), name
    with pytest.raises(ValueError, match="needs its own process group"):
        save_checkpoint(model, optimizer, path + "_x", async_save=True)
    remove_tmpdir(path)
