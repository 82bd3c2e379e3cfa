"""TP x MFSDP training equals a single-process reference (fp32): ZeRO-3, ZeRO-1 and HSDP
for GPT-2 and Llama models with and without sequence parallelism at TP 2 and 4, and
ZeRO-2, no_shard and HFSDP for the Llama model with sequence parallelism.

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
from _dist_helpers import check, make_optimizer
from _tp_models import (
    ARCHITECTURES,
    MAX_NORM,
    assert_pieces_match,
    HYBRID,
    build_gpt,
    global_batches,
    more_tp_layouts,
    named_pieces,
    parallel_state,
    reference_piece,
    tp_world_layouts,
    train_parallel,
    train_reference,
    wrap_tp,
)

from megatron.core.optimizer import count_zeros, get_params_norm
from megatron.core.tensor_parallel import tensor_parallel_parameters

SEQUENCE_PARALLEL = (False, True) if dist.get_world_size() > 1 else (False,)


@pytest.mark.parametrize("sequence_parallel", SEQUENCE_PARALLEL)
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("tp,strategy", tp_world_layouts())
def test_tensor_parallel_training_equals_single_process(tp, strategy, arch, sequence_parallel):
    _check_training(tp, strategy, arch, sequence_parallel)


@pytest.mark.parametrize("tp,strategy", more_tp_layouts())
def test_other_strategies_with_tensor_parallelism(tp, strategy):
    _check_training(tp, strategy, "llama", tp > 1)


def _check_training(tp, strategy, arch, sequence_parallel):
    state = parallel_state(tp, dp_outer=2 if strategy in HYBRID else 1)
    batches = global_batches(2)
    reference = build_gpt(arch)
    model = build_gpt(arch, state, sequence_parallel)
    # The same global weights at every TP size (the invariant initializer cuts the pieces).
    for name, module, attr, param in named_pieces(model):
        expected = reference_piece(dict(reference.named_parameters())[name].detach(), module, attr)
        check(torch.equal(param.detach(), expected), f"initial {name} differs from the reference's piece")

    ref_losses, ref_norms = train_reference(reference, make_optimizer("sgd", reference.parameters()), batches)
    ctx, opt = wrap_tp(model, state, strategy)
    losses, norms = train_parallel(model, ctx, opt, state, sequence_parallel, batches)

    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(norms).float(), torch.stack(ref_norms).float(), rtol=1e-4, atol=1e-6)
    check(all(float(n) > MAX_NORM for n in ref_norms), "clipping was not active; lower MAX_NORM")
    assert_pieces_match(model, reference)
    # --log-params-norm and --log-num-zeros-in-grad count each TP piece and replica once.
    split = dict(tensor_parallel_params=tensor_parallel_parameters(model), tp_group=state.tp_group)
    ref_norm = torch.linalg.vector_norm(torch.cat([p.detach().reshape(-1) for p in reference.parameters()]))
    torch.testing.assert_close(get_params_norm(list(model.parameters()), **split), ref_norm, rtol=1e-5, atol=1e-6)
    if arch == "llama":  # GPT-2's key-bias gradients are zero up to rounding: their zero count is noise
        ref_zeros = sum(int((p.grad == 0).sum()) for p in reference.parameters())  # the padding rows
        check(ref_zeros > 0 and count_zeros(list(model.parameters()), **split) == ref_zeros,
              "zero-gradient count differs")
