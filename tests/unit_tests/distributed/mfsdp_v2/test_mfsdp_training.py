"""ZeRO-3 training against a single-process reference: losses, weights and gradients.

The reference is a deepcopy of the model taken before ``fully_shard``, trained on the whole
global batch; every rank trains the wrapped model on its slice of each microbatch. The
sharded losses are averaged over ranks (SUM then divide), the sharded weights and
gradients are compared row by row with the matching rows of the reference tensors.
"""

import pytest
import torch

from _mfsdp_models import CASES, expected_local, gather_full, shard_infos, train_case

STEPS = 5


def _check_against_reference(model, reference, ctx, losses, ref_losses, atol):
    torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=atol)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for info in shard_infos(model, ctx):
        ref = ref_params[info.name]
        torch.testing.assert_close(
            info.param.to_local(), expected_local(ref, info), rtol=1e-4, atol=atol, msg=lambda m: f"{info.name}: {m}"
        )
        if ref.requires_grad:
            grad = info.param.grad
            assert grad is not None, f"{info.name} has no gradient after the last backward"
            torch.testing.assert_close(
                grad.to_local(), expected_local(ref.grad, info), rtol=1e-4, atol=atol,
                msg=lambda m: f"{info.name} grad: {m}",
            )
        else:
            assert info.param.grad is None, f"frozen {info.name} got a gradient"


@pytest.mark.parametrize("microbatches", [1, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(case, optimizer, microbatches):
    model, reference, ctx, _, losses, ref_losses = train_case(CASES[case], optimizer, microbatches, STEPS)
    assert losses.shape == (STEPS,)
    # The run must actually train (guards against a test that compares two frozen models).
    assert not torch.allclose(ref_losses[0], ref_losses[-1])
    _check_against_reference(model, reference, ctx, losses, ref_losses, atol=2e-5)


def test_full_weights_rebuilt_from_all_ranks_match_reference():
    """Rebuild every full weight from all ranks' local rows (own all-gather) after training."""
    model, reference, ctx, _, _, _ = train_case(CASES["nested"], "adamw", 3, STEPS)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for info in shard_infos(model, ctx):
        full = gather_full(info.param.to_local(), info)
        torch.testing.assert_close(full, ref_params[info.name].detach(), rtol=1e-4, atol=2e-5)
        full_grad = gather_full(info.param.grad.to_local(), info)
        torch.testing.assert_close(full_grad, ref_params[info.name].grad, rtol=1e-4, atol=2e-5)
