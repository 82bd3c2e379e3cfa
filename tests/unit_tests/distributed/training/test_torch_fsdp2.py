"""``--use-torch-fsdp2`` (PyTorch's FSDP2) against ``--use-mfsdp`` through the trainer's functions.

Run at 2 and 4 gloo ranks. Both backends are built by ``build_model`` from the same flags
and trained by the trainer's own step pieces (schedule with 2 microbatches per rank,
``finalize_model_grads``, ``get_grad_norm_and_clip`` with clipping active, optimizer and
LR step) on the same global batches. The reference for the initial weights is a plain
single-process build. Checkpoints go through ``megatron/training/checkpointing.py``.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from _trainer_models import batches, full_weights, gpt_provider, trainer_args
from megatron.core import parallel_state
from megatron.core.global_slices import global_slices_by_name
from megatron.core.pipeline_parallel import forward_backward_no_pipelining
from megatron.core.transformer.initialization import initialize_parameters_
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.training.model_builder import (
    build_model, build_optimizer, finalize_model_grads, get_grad_norm_and_clip, reshard_torch_fsdp2)

CPU = torch.device("cpu")
MFSDP, FSDP2 = "--use-mfsdp", "--use-torch-fsdp2"


WORLD = dist.get_world_size()
# name -> (architecture, flags, TP size): tied embeddings with LayerNorm; untied with
# RMSNorm, RoPE, SwiGLU and GQA; that one under TP 2 with sequence parallelism.
CASES = {"gpt2": ("gpt2", (), 1), "llama": ("llama", (), 1),
         "llama-tp2-sp": ("llama", ("--tensor-model-parallel-size", "2", "--sequence-parallel"), 2)}
NO_RESHARD = "--torch-fsdp2-no-reshard-after-forward"


@contextlib.contextmanager
def _parallel_state(case):
    """The trainer's parallel state for the case's TP size (the model provider reads it)."""
    tp = CASES[case][2]
    if tp == 1:
        yield
        return
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1, "cpu")
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


def _args(case, backend, *extra):
    # 2+ microbatches of 2 per data-parallel rank; a clip threshold the gradients exceed.
    arch, flags, _ = CASES[case]
    return trainer_args(arch, backend, "--global-batch-size", str(4 * WORLD), "--clip-grad", "0.05", *flags, *extra)


def _forward_step(data_iterator, model):
    from pretrain_gpt import forward_step

    return forward_step(data_iterator, model)


def _train(args, built, optimizer, scheduler, steps):
    """(loss, grad norm) of each of ``steps`` trainer steps, the same on every rank."""
    dp = parallel_state.get_parallel_state() if parallel_state.model_parallel_is_initialized() else None
    world, rank = (dp.dp_size, dp.dp_rank) if dp is not None else (WORLD, dist.get_rank())
    per_rank = args.global_batch_size // world
    out = []
    for batch in batches(steps, args.micro_batch_size, args.global_batch_size, args.seq_length, 96):
        mine = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}
        mbs = [{k: v[i:i + args.micro_batch_size] for k, v in mine.items()}
               for i in range(0, per_rank, args.micro_batch_size)]
        optimizer.zero_grad(set_to_none=True)
        reports = forward_backward_no_pipelining(_forward_step, iter(mbs), built.model, len(mbs),
                                                 context=built.context)
        finalize_model_grads(args, built)
        norm = float(get_grad_norm_and_clip(args, built, optimizer))
        optimizer.step()
        scheduler.step(increment=args.global_batch_size)
        report = torch.stack([r["lm loss"] for r in reports]).sum(0)
        dist.all_reduce(report)
        out.append(((report[0] / report[1]).item(), norm))
    return out


# (arch, backend) -> the 3 straight steps' (loss, grad norm): plain floats, kept for the module.
_STRAIGHT = {}


def _run(case, backend, check_initial_weights=False):
    if (case, backend) in _STRAIGHT:
        return _STRAIGHT[case, backend]
    with _parallel_state(case):
        args = _args(case, backend)
        built = build_model(gpt_provider, args, CPU)
        assert (built.torch_fsdp2, built.use_mfsdp) == (backend == FSDP2, backend == MFSDP)
        if check_initial_weights:  # against a plain single-process build (its TP pieces)
            reference = gpt_provider(trainer_args(CASES[case][0], world_size=1))
            initialize_parameters_(reference, args.seed)
            got, pieces = full_weights(built.model), global_slices_by_name(built.unwrapped)
            for name, expected in reference.named_parameters():
                expected = pieces[name].take(expected.detach()) if name in pieces else expected.detach()
                torch.testing.assert_close(got[name], expected, rtol=0, atol=0, msg=name)
        optimizer, scheduler = build_optimizer(args, built)
        _STRAIGHT[case, backend] = _train(args, built, optimizer, scheduler, 3)
    return _STRAIGHT[case, backend]


def _assert_close(got, expected, rel=1e-5):
    for (loss, norm), (loss_ref, norm_ref) in zip(got, expected, strict=True):
        assert abs(loss - loss_ref) <= rel * abs(loss_ref), (got, expected)
        assert abs(norm - norm_ref) <= rel * abs(norm_ref), (got, expected)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp2_losses_equal_mfsdp(case):
    fsdp2 = _run(case, FSDP2, check_initial_weights=True)
    mfsdp = _run(case, MFSDP)
    if dist.get_rank() == 0:
        for i, ((a, na), (b, nb)) in enumerate(zip(mfsdp, fsdp2)):
            print(f"\nparity world={WORLD} {case} iter {i + 1}: loss mfsdp {a:.8f} fsdp2 {b:.8f} "
                  f"rel {abs(a - b) / abs(a):.1e}; grad norm mfsdp {na:.8f} fsdp2 {nb:.8f} rel {abs(na - nb) / na:.1e}")
    _assert_close(fsdp2, mfsdp)
    assert fsdp2[2][0] < fsdp2[0][0]  # it trains


def test_gradients_reduce_once_per_step():
    """2 microbatches per rank: one reduce-scatter per unit (2 layers and the root), in the
    last microbatch's backward; the first accumulates locally."""
    args = _args("gpt2", FSDP2)
    built = build_model(gpt_provider, args, CPU)
    optimizer, scheduler = build_optimizer(args, built)
    # Counted from the profiler's record of the c10d operators (torch is not patched).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _train(args, built, optimizer, scheduler, 1)
    calls = [event for event in prof.events() if event.name.startswith("c10d::") and "reduce_scatter" in event.name]
    assert args.global_batch_size // WORLD // args.micro_batch_size == 2 and len(calls) == 3


def test_no_reshard_after_forward_trains_alike_and_evaluation_reshards():
    """Layers kept gathered from forward to backward: the same losses; after a forward-only
    pass (what evaluation runs) the trainer's reshard leaves every weight sharded."""
    args = _args("gpt2", FSDP2, NO_RESHARD)
    built = build_model(gpt_provider, args, CPU)
    optimizer, scheduler = build_optimizer(args, built)
    _assert_close(_train(args, built, optimizer, scheduler, 3), _run("gpt2", MFSDP))
    tokens = batches(1, 2, 2, args.seq_length, 96)[0]
    forward_backward_no_pipelining(_forward_step, iter([tokens]), built.model, 1, forward_only=True)
    assert not all(isinstance(p, DTensor) for p in built.model.parameters())  # still gathered
    reshard_torch_fsdp2(built.model)
    assert all(isinstance(p, DTensor) for p in built.model.parameters())


def _shared_dir(tmp_path_factory, name):
    holder = [str(tmp_path_factory.mktemp(name)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder)
    return holder[0]


MOVES = [(case, first, then) for case in ("gpt2", "llama-tp2-sp") for first, then in ((MFSDP, FSDP2), (FSDP2, MFSDP))]


@pytest.mark.parametrize("case, first, then", MOVES,
                         ids=[f"{c}-{a[6:]}-to-{b[6:]}" for c, a, b in MOVES])
def test_checkpoint_moves_between_backends(case, first, then, tmp_path_factory):
    """2 steps under one backend, a checkpoint, 1 step under the other after loading it:
    the same losses as 3 steps straight through."""
    straight = _run(case, first)
    path = _shared_dir(tmp_path_factory, "fsdp2_ckpt")
    with _parallel_state(case):
        args = _args(case, first, "--save", path)
        built = build_model(gpt_provider, args, CPU)
        optimizer, scheduler = build_optimizer(args, built)
        before = _train(args, built, optimizer, scheduler, 2)
        save_checkpoint(2, built.model, optimizer, scheduler, args, consumed_train_samples=2 * args.global_batch_size)

        args = _args(case, then, "--load", path)
        built = build_model(gpt_provider, args, CPU)
        optimizer, scheduler = build_optimizer(args, built)
        iteration, consumed = load_checkpoint(built.model, optimizer, scheduler, args, load_rng=False)
        assert (iteration, consumed) == (2, 2 * args.global_batch_size)
        after = _train(args, built, optimizer, scheduler, 1)
    _assert_close(before + after, straight)
