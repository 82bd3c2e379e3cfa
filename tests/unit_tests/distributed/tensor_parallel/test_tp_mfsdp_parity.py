"""TP x MFSDP training equals a single-process reference (fp32).

The model's tensor-parallel pieces are sharded by the engine over the data-parallel
sub-mesh only. Each step: every DP rank takes its rows of the global batch (all TP ranks
of a DP rank the same rows), the sequence-parallel gradients are summed over TP, the
gradients are clipped by the TP-aware global norm, then SGD with momentum steps (Adam
would turn the rounding noise of the exactly-zero key-bias gradients into whole steps).
The reference trains the TP size 1 model on the whole global batch with torch's own
clipping. Losses, gradient norms and every rank's piece of every weight must agree.
"""

import pytest
import torch
import torch.distributed as dist
from _dist_helpers import check, full_tensors, make_optimizer, wrap
from _tp_models import ARCHITECTURES, build_gpt, named_pieces, parallel_state, reference_piece, token_batch, tp_world_layouts

from megatron.core.distributed.mfsdp_v2 import Placements, fully_shard_optimizer, microbatch
from megatron.core.optimizer import clip_grad_norm
from megatron.core.tensor_parallel import all_reduce_sequence_parallel_grads, tensor_parallel_parameters

STEPS, MICROBATCHES, MAX_NORM = 2, 2, 0.5
ROWS = 4  # global microbatch rows (a multiple of every DP size here)
PLACEMENTS = {"zero3": lambda: Placements.zero3("dp"), "zero1": lambda: Placements.zero1("dp"),
              "hsdp": lambda: Placements.hsdp("outer", "inner")}
SEQUENCE_PARALLEL = (False, True) if dist.get_world_size() > 1 else (False,)


def _train_reference(reference, batches):
    opt = make_optimizer("sgd", reference.parameters())
    losses, norms = [], []
    for step in batches:
        opt.zero_grad()
        ids = torch.cat([b[0] for b in step])
        labels = torch.cat([b[1] for b in step])
        loss = reference(ids, labels=labels).mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM))
        opt.step()
        losses.append(loss.detach())
    return losses, norms


def _train_parallel(model, state, placements, sequence_parallel, batches):
    units = list(model.decoder.layers) + [model]
    ctx = wrap(model, units=units, mesh=state.dp_mesh, placements=placements)
    opt = fully_shard_optimizer(make_optimizer("sgd", model.parameters()))
    split = tensor_parallel_parameters(model)
    losses, norms = [], []
    for step in batches:
        opt.zero_grad()
        total = torch.zeros(())
        for i, (ids, labels) in enumerate(step):
            rows = ids.shape[0] // state.dp_size
            mine = slice(state.dp_rank * rows, (state.dp_rank + 1) * rows)
            with microbatch(ctx, is_last=i == len(step) - 1):
                loss = model(ids[mine], labels=labels[mine]).mean() / len(step)
                loss.backward()
            total += loss.detach()
        if sequence_parallel:
            all_reduce_sequence_parallel_grads(model, state.tp_group)
        params = list(model.parameters())
        norms.append(clip_grad_norm(params, MAX_NORM, tensor_parallel_params=split, tp_group=state.tp_group))
        opt.step()
        dist.all_reduce(total, group=state.dp_group)
        losses.append(total / state.dp_size)
    return losses, norms


@pytest.mark.parametrize("sequence_parallel", SEQUENCE_PARALLEL)
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("tp,strategy", tp_world_layouts())
def test_tensor_parallel_training_equals_single_process(tp, strategy, arch, sequence_parallel):
    state = parallel_state(tp, dp_outer=2 if strategy == "hsdp" else 1)
    generator = torch.Generator().manual_seed(5)
    batches = [[token_batch(generator, ROWS) for _ in range(MICROBATCHES)] for _ in range(STEPS)]
    reference = build_gpt(arch)
    model = build_gpt(arch, state, sequence_parallel)
    # The same global weights at every TP size (the invariant initializer cuts the pieces).
    for name, module, attr, param in named_pieces(model):
        expected = reference_piece(dict(reference.named_parameters())[name].detach(), module, attr)
        check(torch.equal(param.detach(), expected), f"initial {name} differs from the reference's piece")

    ref_losses, ref_norms = _train_reference(reference, [[(ids, labels) for ids, labels in step]
                                                         for step in batches])
    losses, norms = _train_parallel(model, state, PLACEMENTS[strategy](), sequence_parallel, batches)

    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(norms).float(), torch.stack(ref_norms).float(), rtol=1e-4, atol=1e-6)
    check(all(float(n) > MAX_NORM for n in ref_norms), "clipping was not active; lower MAX_NORM")
    pieces = list(named_pieces(model))
    fulls = full_tensors([param for _, _, _, param in pieces])  # unsharded over DP, still TP pieces
    ref = dict(reference.named_parameters())
    for (name, module, attr, _), full in zip(pieces, fulls):
        torch.testing.assert_close(full, reference_piece(ref[name].detach(), module, attr), rtol=1e-4, atol=2e-5,
                                   msg=lambda m: f"{name}: {m}")
