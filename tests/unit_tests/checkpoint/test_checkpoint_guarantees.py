"""megatron/training/checkpointing.py: atomic saves, integrity checks before the model is
touched, the load flags, RNG state, and the exit signal (single process)."""

import argparse
import os
import pickle
import random
import shutil
import signal

import numpy as np
import pytest
import torch

from megatron.core.distributed.mfsdp_v2.checkpoint import manifest
from megatron.core.distributed.mfsdp_v2.checkpoint import save as engine_save
from megatron.core.optimizer import OptimizerConfig, OptimizerParamScheduler, get_megatron_optimizer
from megatron.training import checkpointing
from megatron.training.checkpointing import (
    TRACKER_FILENAME,
    checkpoint_dir,
    load_checkpoint,
    load_common,
    read_tracker,
    save_checkpoint,
)


def make(seed, hidden=8):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 2))
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.01), model)
    sched = OptimizerParamScheduler(opt, 0.0, 0.01, 0.001, 4, 40, "cosine", weight_decay=0.01)
    return model, opt, sched


def steps(model, opt, sched, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        torch.nn.functional.dropout(model(torch.randn(3, 4, generator=g)), 0.5).pow(2).sum().backward()
        opt.step()
        sched.step(2)


def snapshot(model, opt):
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()})


def assert_unchanged(model, opt, snap):
    params, state = snap
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
    assert {id(p) for p in opt.state} == set(state)


@pytest.fixture
def args(tmp_path):
    return argparse.Namespace(save=str(tmp_path), load=str(tmp_path), global_batch_size=2)


def test_layout_and_contents(tmp_path, args):
    model, opt, sched = make(0)
    steps(model, opt, sched, 2)
    path = save_checkpoint(2, model, opt, sched, args, consumed_train_samples=4)
    assert path == checkpoint_dir(str(tmp_path), 2)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", TRACKER_FILENAME]
    names = sorted(os.listdir(path))
    assert names == [".metadata", "__0_0.distcp", "common.json", manifest.MANIFEST_NAME, "rng"]
    _, common = load_common(str(tmp_path))
    assert common["iteration"] == 2 and common["consumed_train_samples"] == 4
    assert common["data"]["consumed_train_samples"] == 4
    assert common["opt_param_scheduler"]["num_steps"] == sched.num_steps
    assert common["args"]["global_batch_size"] == 2
    assert list(common["rng_files"]) == ["rng/rank_00000.pt"]


def test_resume_is_exact_including_rng(args):
    model, opt, sched = make(0)
    steps(model, opt, sched, 3)
    save_checkpoint(3, model, opt, sched, args, consumed_train_samples=6)
    expected_random = (random.random(), np.random.rand(), torch.rand(3))
    steps(model, opt, sched, 2, seed=1)

    model2, opt2, sched2 = make(5)
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    assert load_checkpoint(model2, opt2, sched2, args) == (3, 6)
    got_random = (random.random(), np.random.rand(), torch.rand(3))
    assert got_random[:2] == expected_random[:2] and torch.equal(got_random[2], expected_random[2])
    # Replay what happened after the save: consume the same random numbers, train the same steps.
    load_checkpoint(model2, opt2, sched2, args)
    random.random(), np.random.rand(), torch.rand(3)
    steps(model2, opt2, sched2, 2, seed=1)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_load_flags(args):
    model, opt, sched = make(0)
    steps(model, opt, sched, 2)
    save_checkpoint(2, model, opt, sched, args, consumed_train_samples=4)

    fresh, fresh_opt, fresh_sched = make(1)
    args.finetune = True
    assert load_checkpoint(fresh, fresh_opt, fresh_sched, args) == (0, 0)
    assert not fresh_opt.state and fresh_sched.num_steps == 0
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)

    args.finetune = False
    fresh, fresh_opt, fresh_sched = make(1)
    assert load_checkpoint(fresh, fresh_opt, fresh_sched, args, load_optim=False) == (2, 4)
    assert not fresh_opt.state and fresh_sched.num_steps == 0

    torch.manual_seed(7)
    before = torch.get_rng_state()
    load_checkpoint(fresh, fresh_opt, fresh_sched, args, load_rng=False)
    assert torch.equal(torch.get_rng_state(), before)
    assert fresh_opt.state and fresh_sched.num_steps == sched.num_steps

    # --load pointing at an iteration directory works too.
    args.load = checkpoint_dir(args.save, 2)
    assert load_checkpoint(*make(3), args) == (2, 4)


def test_start_from_scratch_without_tracker(tmp_path, capsys):
    model, opt, sched = make(0)
    assert load_checkpoint(model, opt, sched, argparse.Namespace(load=str(tmp_path / "none"))) == (0, 0)
    assert "starting from scratch" in capsys.readouterr().out
    assert load_checkpoint(model, opt, sched, argparse.Namespace(load=None)) == (0, 0)


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, args, monkeypatch):
    model, opt, sched = make(0)
    steps(model, opt, sched, 1)
    save_checkpoint(1, model, opt, sched, args)
    at_one = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps(model, opt, sched, 1)

    def dies(*a, **k):
        raise KeyboardInterrupt("killed while writing")

    # Killed while the engine writes data, and (second attempt) at the first directory fsync
    # (the engine's manifest is in place, the iteration directory is not yet renamed).
    for module, target in ((engine_save, "write_checkpoint"), (manifest, "fsync_dir")):
        with monkeypatch.context() as m:
            m.setattr(module, target, dies)
            with pytest.raises(KeyboardInterrupt):
                save_checkpoint(2, model, opt, sched, args)
        assert read_tracker(str(tmp_path)) == 1
        assert not os.path.exists(checkpoint_dir(str(tmp_path), 2))
        assert os.path.isdir(checkpoint_dir(str(tmp_path), 2) + ".tmp")
        fresh, fresh_opt, fresh_sched = make(4)
        assert load_checkpoint(fresh, fresh_opt, fresh_sched, args)[0] == 1
        for n, p in fresh.named_parameters():
            assert torch.equal(p, at_one[n]), n
    # The next save clears the leftover and completes.
    save_checkpoint(2, model, opt, sched, args)
    assert read_tracker(str(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "iter_0000002", TRACKER_FILENAME]


def test_saving_an_iteration_again_replaces_it(tmp_path, args):
    model, opt, sched = make(0)
    save_checkpoint(1, model, opt, sched, args)
    steps(model, opt, sched, 1)
    save_checkpoint(1, model, opt, sched, args)
    fresh, fresh_opt, fresh_sched = make(2)
    load_checkpoint(fresh, fresh_opt, fresh_sched, args)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", TRACKER_FILENAME]


@pytest.mark.parametrize("victim", ["data", "common", "rng", "manifest"])
def test_corrupt_files_are_named_before_the_model_is_touched(args, victim):
    model, opt, sched = make(0)
    steps(model, opt, sched, 2)
    path = save_checkpoint(2, model, opt, sched, args)
    name = {"data": "__0_0.distcp", "common": "common.json", "rng": "rng/rank_00000.pt",
            "manifest": manifest.MANIFEST_NAME}[victim]
    target = os.path.join(path, name)
    blob = bytearray(open(target, "rb").read())
    blob[len(blob) // 2] ^= 0x01
    open(target, "wb").write(bytes(blob))

    fresh, fresh_opt, fresh_sched = make(3)
    steps(fresh, fresh_opt, fresh_sched, 1)
    snap = snapshot(fresh, fresh_opt)
    rng = torch.get_rng_state()
    with pytest.raises(RuntimeError, match=name.split("/")[-1].replace(".", r"\.") + ".*(corrupt|match)"):
        load_checkpoint(fresh, fresh_opt, fresh_sched, args)
    assert_unchanged(fresh, fresh_opt, snap)
    assert fresh_sched.num_steps == 2 and torch.equal(torch.get_rng_state(), rng)


def test_truncated_data_file(args):
    model, opt, sched = make(0)
    path = save_checkpoint(1, model, opt, sched, args)
    with open(os.path.join(path, "__0_0.distcp"), "r+b") as f:
        f.truncate(1000)
    fresh, fresh_opt, fresh_sched = make(3)
    snap = snapshot(fresh, fresh_opt)
    with pytest.raises(RuntimeError, match=r"__0_0\.distcp has 1000 bytes"):
        load_checkpoint(fresh, fresh_opt, fresh_sched, args)
    assert_unchanged(fresh, fresh_opt, snap)


def test_missing_iteration_directory(tmp_path, args):
    model, opt, sched = make(0)
    path = save_checkpoint(1, model, opt, sched, args)
    shutil.rmtree(path)
    with pytest.raises(RuntimeError, match="incomplete"):
        load_checkpoint(model, opt, sched, args)


def test_shape_mismatch_names_the_tensor(args):
    model, opt, sched = make(0)
    save_checkpoint(1, model, opt, sched, args)
    other, other_opt, other_sched = make(1, hidden=6)
    snap = snapshot(other, other_opt)
    with pytest.raises(RuntimeError, match=r"tensor '0.bias' has shape \(8,\) in the checkpoint but \(6,\) in the model"):
        load_checkpoint(other, other_opt, other_sched, args)
    assert_unchanged(other, other_opt, snap)


def test_nothing_is_unpickled_except_weights_only(args, monkeypatch):
    model, opt, sched = make(0)
    steps(model, opt, sched, 1)
    save_checkpoint(1, model, opt, sched, args)

    def forbidden(*a, **k):
        raise AssertionError("unpickling outside torch.load(weights_only=True)")

    real_load = torch.load
    calls = []

    def checked_load(*a, **k):
        assert k.get("weights_only") is True, "torch.load without weights_only=True"
        calls.append(1)
        return real_load(*a, **k)

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(torch, "load", checked_load)
    fresh, fresh_opt, fresh_sched = make(3)
    assert load_checkpoint(fresh, fresh_opt, fresh_sched, args) == (1, 0)
    assert calls  # tensor data and the RNG file did go through torch.load(weights_only=True)


def test_exit_signal_handler_turns_sigterm_into_a_flag():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        checkpointing.install_exit_signal_handler()
        assert not checkpointing.exit_signal_received()
        os.kill(os.getpid(), signal.SIGTERM)
        assert checkpointing.exit_signal_received()
    finally:
        signal.signal(signal.SIGTERM, previous)
        checkpointing._ExitSignal.received = False


def test_async_save_completes_on_finalize(tmp_path, args):
    model, opt, sched = make(0)
    steps(model, opt, sched, 1)
    args.async_save = True
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    save_checkpoint(1, model, opt, sched, args)
    steps(model, opt, sched, 1)  # training goes on while the save is written
    checkpointing.finalize_async_save()
    assert read_tracker(str(tmp_path)) == 1
    fresh, fresh_opt, fresh_sched = make(3)
    load_checkpoint(fresh, fresh_opt, fresh_sched, args)
    for n, p in fresh.named_parameters():
        assert torch.equal(p, expected[n]), n
