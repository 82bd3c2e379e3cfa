"""The DTensors the engine hands out (parameters, ``.grad``, optimizer state) tell the
truth about their layout: torch's own ``full_tensor()``, ``redistribute()`` and
``torch.nn.utils.clip_grad_norm_`` give the single-process reference's values under every
strategy, with uneven row shards and ranks that hold no rows; where DTensor cannot
describe the layout (HFSDP's nested optimizer shards) they raise a clear error."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from megatron.core.distributed.mfsdp_v2 import clip_grad_norm_
from megatron.core.distributed.mfsdp_v2.row_shard import NestedRowShard

from _dist_helpers import H, check, train_pair, world
from _strategy_common import Net, case_id, sharding, strategy_cases

CASES = strategy_cases()


class Narrow(nn.Module):
    """A head with a single output row: at 4 ranks most ranks hold no rows of it."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(H, H)
        self.head = nn.Linear(H, 1)
        self.out = nn.Linear(1, H, bias=False)

    def forward(self, x):
        return self.out(torch.tanh(self.head(torch.tanh(self.body(x)))))

    def units(self):
        return [self]


def _trained(case, model_cls=None):
    """Two AdamW steps of the wrapped model and its reference; ``.grad`` holds the last step's."""
    build = Net if model_cls is None else model_cls
    model, reference, ctx, opt, _, _ = train_pair(build, "adamw", microbatches=2, steps=2, **sharding(case))
    return model, reference, ctx, opt


def _nested(case) -> bool:
    return case[0] == "hfsdp"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
@pytest.mark.parametrize("model_cls", [None, Narrow], ids=["net", "narrow"])
def test_full_tensor_of_parameters_and_grads(case, model_cls):
    model, reference, _, _ = _trained(case, model_cls)
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        check(isinstance(param, DTensor), f"{name} is not a DTensor")
        if any(isinstance(pl, NestedRowShard) for pl in param.placements) and param.device_mesh.size() > 1:  # one rank: nothing to move
            with pytest.raises(NotImplementedError, match="HFSDP"):
                param.full_tensor()
            # Its local shape and global offset are still exact: checkpoints rely on them.
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            rows = shape[0] if param.dim() else 1
            expected = ref[name].detach().reshape(param.shape)[offset[0]:offset[0] + rows] if param.dim() else ref[name].detach()
            torch.testing.assert_close(param.to_local(), expected, rtol=1e-4, atol=2e-5)
            continue
        torch.testing.assert_close(param.full_tensor(), ref[name].detach(), rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(param.grad.full_tensor(), ref[name].grad, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("case", [c for c in CASES if not _nested(c)], ids=[case_id(c) for c in CASES if not _nested(c)])
def test_redistribute_round_trip_and_optimizer_state(case):
    model, reference, _, opt = _trained(case, Narrow)
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        replicated = param.redistribute(param.device_mesh, [Replicate()] * param.device_mesh.ndim)
        torch.testing.assert_close(replicated.to_local(), ref[name].detach(), rtol=1e-4, atol=2e-5)
        back = replicated.redistribute(param.device_mesh, param.placements)
        check(torch.equal(back.to_local(), param.to_local()), f"{name}: Replicate -> original placement changed values")
        # Partial -> the original placement: a reduce-scatter that keeps the true rows.
        partial = DTensor.from_local(ref[name].detach() / world(), param.device_mesh, [Partial()] * param.device_mesh.ndim,
                                     run_check=False)
        reduced = partial.redistribute(param.device_mesh, param.placements)
        check(reduced.to_local().shape == param.to_local().shape, f"{name}: Partial -> placement gave the wrong local rows")
        torch.testing.assert_close(reduced.full_tensor(), ref[name].detach(), rtol=1e-5, atol=1e-6)
        state = opt.state[param]["exp_avg"]
        check(state.placements == param.placements, f"{name}: optimizer state lost its placements")
        check(state.full_tensor().shape == param.shape, f"{name}: optimizer state has the wrong global shape")


@pytest.mark.parametrize("case", [c for c in CASES if not _nested(c)], ids=[case_id(c) for c in CASES if not _nested(c)])
def test_torch_clip_grad_norm_equals_ours_and_the_reference(case):
    model, reference, _, _ = _trained(case, Narrow)
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    ours = clip_grad_norm_(model.parameters(), max_norm=1e9)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-6)
    theirs = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    theirs = theirs.full_tensor() if isinstance(theirs, DTensor) else theirs
    torch.testing.assert_close(theirs, expected, rtol=1e-4, atol=1e-6)
