"""Checkpoints of a tensor-parallel model hold the global tensors at their true offsets.

Saved at TP=2 (x DP=2 at 4 ranks) after one training step, a checkpoint loads into other
TP sizes and strategies (model and optimizer state) and into a plain single-process
model. The loaded weights equal the single-process reference's after that step, and one
more step from the loaded state matches the reference's next step (the optimizer state
moved with the weights).
"""

import pytest
import torch
import torch.distributed as dist
from _dist_helpers import make_optimizer
from _tp_models import (
    ARCHITECTURES,
    assert_pieces_match,
    build_gpt,
    global_batches,
    parallel_state,
    train_parallel,
    train_reference,
    wrap_tp,
)

from megatron.core.distributed.mfsdp_v2.checkpoint import MODEL_PREFIX, load_checkpoint, load_tensors, save_checkpoint
from megatron.core.global_slices import global_slices_by_name

WORLD = dist.get_world_size()
SAVE_LAYOUT = (min(2, WORLD), "zero3")
LOAD_LAYOUTS = {4: [(1, "zero3"), (4, "zero1"), (2, "hsdp")], 2: [(1, "zero3")], 1: [(1, "zero1")]}[WORLD]


@pytest.fixture
def shared_dir(tmp_path):
    path = [str(tmp_path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)  # rank 0's directory on every rank
    return path[0]


def _layout(tp, strategy):
    return parallel_state(tp, dp_outer=2 if strategy == "hsdp" else 1)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_save_at_one_tp_size_load_at_others(arch, shared_dir):
    first, second = global_batches(2)
    reference = build_gpt(arch)
    ref_opt = make_optimizer("sgd", reference.parameters())
    train_reference(reference, ref_opt, [first])

    state = _layout(*SAVE_LAYOUT)
    saver = build_gpt(arch, state)
    ctx, opt = wrap_tp(saver, state, SAVE_LAYOUT[1])
    train_parallel(saver, ctx, opt, state, False, [first])
    save_checkpoint(saver, opt, shared_dir, process_group=dist.group.WORLD, pieces=global_slices_by_name(saver))

    # A plain single-process model: the global tensors, read offline.
    if dist.get_rank() == 0:
        names = [name for name, _ in reference.named_parameters()]
        loaded = load_tensors(shared_dir, [MODEL_PREFIX + n for n in names])
        for name, param in reference.named_parameters():
            torch.testing.assert_close(loaded[MODEL_PREFIX + name], param.detach(), rtol=1e-5, atol=1e-6)

    ref_losses, _ = train_reference(reference, ref_opt, [second])
    for tp, strategy in LOAD_LAYOUTS:
        state = _layout(tp, strategy)
        model = build_gpt(arch, state)
        ctx, opt = wrap_tp(model, state, strategy)
        load_checkpoint(model, opt, shared_dir, process_group=dist.group.WORLD, pieces=global_slices_by_name(model))
        losses, _ = train_parallel(model, ctx, opt, state, False, [second])
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
        assert_pieces_match(model, reference)
