"""The DTensors the engine hands out (parameters, ``.grad``, optimizer state) tell the
truth about their layout: torch's own ``full_tensor()``, ``redistribute()`` and
``torch.nn.utils.clip_grad_norm_`` give the single-process reference's values under every
strategy, with uneven row shards and ranks that hold no rows; where DTensor cannot
describe the layout (HFSDP's nested optimizer shards) they raise a clear error."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from megatron.core.distributed.mfsdp_v2 import clip_grad_norm_
from megatron.core.distributed.mfsdp_v2.row_shard import NestedRowShard, RowShard
from megatron.core.distributed.mfsdp_v2.row_sharded_tensor import RowShardedTensor

from _dist_helpers import H, check, compare_params, kept_groups, module_cache, train_pair, world
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


_TRAINED: dict = module_cache()  # the models (and what they hold) do not outlive this module


def _trained(case, model_cls=None):
    """Two AdamW steps of the wrapped model and its reference; ``.grad`` holds the last step's.
    Trained once per (strategy, model) for all the tests below, which only read the result
    (operators out of place; the clipping test's max_norm leaves the gradients as they are)."""
    build = Net if model_cls is None else model_cls
    key = (case_id(case), build)
    if key not in _TRAINED:
        with kept_groups():
            model, reference, ctx, opt, _, _ = train_pair(build, "adamw", microbatches=2, steps=2, **sharding(case))
        _TRAINED[key] = model, reference, ctx, opt
    return _TRAINED[key]


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
        state = opt.state[param]["exp_avg"]
        check(state.placements == param.placements, f"{name}: optimizer state lost its placements")
        check(state.full_tensor().shape == param.shape, f"{name}: optimizer state has the wrong global shape")
        # Partial -> the original placement: torch's reduce-scatter where the rows are its
        # own split. A plain DTensor (a user's own) cannot be taken to rows torch does not
        # know: torch refuses to build the spec (no wrong rows).
        partial = DTensor.from_local(ref[name].detach() / world(), param.device_mesh, [Partial()] * param.device_mesh.ndim,
                                     run_check=False)
        if _uneven(param):
            check(isinstance(param, RowShardedTensor), f"{name}: uneven rows handed out as a plain DTensor")
            with pytest.raises(AssertionError, match="shard_order"):
                partial.redistribute(param.device_mesh, param.placements)
            continue
        reduced = partial.redistribute(param.device_mesh, param.placements)
        check(reduced.to_local().shape == param.to_local().shape, f"{name}: Partial -> placement gave the wrong local rows")
        torch.testing.assert_close(reduced.full_tensor(), ref[name].detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [c for c in CASES if not _nested(c)], ids=[case_id(c) for c in CASES if not _nested(c)])
def test_torch_clip_grad_norm_equals_ours_and_the_reference(case):
    model, reference, _, _ = _trained(case, Narrow)
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    ours = clip_grad_norm_(model.parameters(), max_norm=1e9)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-6)
    theirs = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    theirs = theirs.full_tensor() if isinstance(theirs, DTensor) else theirs
    torch.testing.assert_close(theirs, expected, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------
# Operators on row-sharded DTensors (row_sharded_tensor.py): honest results or a clear error
# --------------------------------------------------------------------------------------

ROW_PRESERVING = {
    "p*2": (lambda t: t * 2, 0.0),
    "p+p.detach()*0.5": (lambda t: t + t.detach() * 0.5, 0.0),
    "sqrt(|p|)": (lambda t: torch.sqrt(t.abs()), 5e-3),  # sqrt magnifies the reference's last digits near 0
}
LAYOUT_CHANGING = {"p.t()": lambda t: t.t(), "p.view(-1)": lambda t: t.view(-1)}


def _nested_dt(x) -> bool:
    return any(isinstance(pl, NestedRowShard) for pl in x.placements) and x.device_mesh.size() > 1


def _uneven(x) -> bool:
    """Rows other than torch's ``torch.chunk`` split, which a plain Shard(0) means."""
    def even(rows):
        chunks = [len(c) for c in torch.arange(sum(rows)).chunk(len(rows))]
        return list(rows) == chunks + [0] * (len(rows) - len(chunks))
    return any(isinstance(pl, RowShard) and not even(pl.rows) for pl in x.placements)


def _engine_tensors(model, reference, opt):
    """(label, DTensor, expected full value) for every parameter, gradient and AdamW state.
    The expected value is the reference's; optimizer state has no reference of its own, so
    its expected value is its own full tensor (exact: the tests above)."""
    ref = dict(reference.named_parameters())
    out = []
    for name, p in model.named_parameters():
        out += [(name, p, ref[name].detach()), (f"{name}.grad", p.grad, ref[name].grad)]
        for key in ("exp_avg", "exp_avg_sq"):
            state = opt.state[p][key]
            out.append((f"{name}.{key}", state, None if _nested_dt(state) else state.full_tensor()))
    return out


def _close(actual, expected, atol, label):
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=1e-4, atol=max(atol, 2e-5),
                               msg=lambda m: f"{label}: {m}")


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
@pytest.mark.parametrize("model_cls", [None, Narrow], ids=["net", "narrow"])
def test_out_of_place_operators_equal_the_reference(case, model_cls):
    model, reference, _, opt = _trained(case, model_cls)
    tensors = _engine_tensors(model, reference, opt)
    for label, x, expected in tensors:
        for name, (fn, atol) in ROW_PRESERVING.items():
            result = fn(x)
            if _nested_dt(x):  # HFSDP optimizer shards: same layout, same local values
                check(result.placements == x.placements, f"{label} {name}: placements {result.placements}")
                _close(result.to_local(), fn(x.to_local()), atol, f"{label} {name}")
                continue
            check(result.placements == x.placements, f"{label} {name}: placements {result.placements} != {x.placements}")
            _close(result.full_tensor(), fn(expected), atol, f"{label} {name}")
        if _uneven(x) and expected is not None:
            # A replicated operand is cut at the rows when read, never written on them only.
            replicated = DTensor.from_local(expected.to(x.dtype).clone(), x.device_mesh, [Replicate()] * x.device_mesh.ndim)
            copied = torch.zeros_like(x).copy_(replicated)
            check(copied.placements == x.placements, f"{label} copy_: placements {copied.placements}")
            _close(copied.full_tensor(), expected, 0.0, f"{label} copy_ from a replicated operand")
            with pytest.raises(NotImplementedError, match="would write an operand"):
                replicated.add_(x)
        if x.dim() == 2:
            if _nested_dt(x):
                with pytest.raises(NotImplementedError, match="HFSDP"):
                    x.sum(1)
            else:
                _close(x.sum(1).full_tensor(), expected.sum(1), 1e-4, f"{label} sum(1)")
                w = torch.linspace(-1.0, 1.0, x.shape[1] * 3).reshape(x.shape[1], 3)
                product = torch.matmul(x, DTensor.from_local(w, x.device_mesh, [Replicate()] * x.device_mesh.ndim))
                _close(product.full_tensor(), expected @ w, 1e-4, f"{label} matmul")
    # One foreach call over tensors with different row splits, as torch.optim makes them.
    plain = [(label, x, expected) for label, x, expected in tensors if not _nested_dt(x)]
    for (label, _, expected), result in zip(plain, torch._foreach_mul([x for _, x, _ in plain], 3.0) if plain else []):
        _close(result.full_tensor(), expected * 3.0, 0.0, f"{label} _foreach_mul")
    nested = [x for _, x, _ in tensors if _nested_dt(x)]
    for x, result in zip(nested, torch._foreach_mul(nested, 3.0) if nested else []):
        check(result.placements == x.placements, f"nested _foreach_mul: placements {result.placements}")
        torch.testing.assert_close(result.to_local(), x.to_local() * 3.0)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
@pytest.mark.parametrize("model_cls", [None, Narrow], ids=["net", "narrow"])
def test_layout_changing_operators_are_right_or_raise(case, model_cls):
    """``p.t()`` / ``p.view(-1)``: where the rows are torch's even split, exactly what torch
    does with a plain ``Shard(0)`` (the reference's values, or torch's own error); where they
    are not, the reference's values (torch 2.14 plans ``view(-1)`` of an (R, 1) tensor
    without moving the rows, and ``t()`` of a one-row tensor as a gather: the true rows are
    kept or gathered) or a one-line NotImplementedError naming full_tensor()."""
    model, reference, _, opt = _trained(case, model_cls)
    for label, x, expected in _engine_tensors(model, reference, opt):
        if x.dim() != 2:
            continue
        for name, fn in LAYOUT_CHANGING.items():
            if _nested_dt(x) or _uneven(x):
                try:
                    result = fn(x)
                except NotImplementedError as error:
                    check(re.search(r"MFSDP v2 row-sharded DTensor|HFSDP", str(error)) is not None, f"{label} {name}: {error}")
                    check("\n" not in str(error), f"{label} {name}: the error is not one line")
                    continue
                check(not _nested_dt(x), f"{label} {name}: did not raise")
                kept = result.placements == x.placements or all(pl.is_replicate() for pl in result.placements)
                check(kept, f"{label} {name}: placements {result.placements}")
                _close(result.full_tensor(), fn(expected), 0.0, f"{label} {name}")
            else:  # torch's even split: exactly what torch does with a plain Shard(0)
                plain = distribute_tensor(expected.clone(), x.device_mesh, [Shard(0) if isinstance(pl, Shard) else
                                                                             Replicate() for pl in x.placements])
                try:
                    want = fn(plain).full_tensor()
                except RuntimeError:
                    with pytest.raises(RuntimeError):
                        fn(x)
                    continue
                _close(fn(x).full_tensor(), fn(expected), 0.0, f"{label} {name}")
                _close(want, fn(expected), 0.0, f"{label} {name} (plain Shard(0))")


@pytest.mark.parametrize("case", [c for c in CASES if not _nested(c)], ids=[case_id(c) for c in CASES if not _nested(c)])
def test_row_shards_and_plain_shards_never_share_a_cached_answer(case):
    """Torch caches sharding propagation and redistribution plans by placement; a plain
    ``Shard(0)`` DTensor of the same shape, used before and after, must not leak into the
    row-sharded one's results, nor the other way round."""
    model, reference, _, _ = _trained(case, Narrow)
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        for x, expected in ((param, ref[name].detach()), (param.grad, ref[name].grad)):
            if not any(isinstance(pl, Shard) for pl in x.placements):
                continue
            even = distribute_tensor(expected.clone(), x.device_mesh,
                                     [Shard(0) if isinstance(pl, Shard) else Replicate() for pl in x.placements])
            for first, second in ((even, x), (x, even)):
                for y in (first, second):
                    _close(y.full_tensor(), expected, 0.0 if y is even else 1e-4, f"{name}: full_tensor")
                    _close((y * 2).full_tensor(), expected * 2, 0.0 if y is even else 1e-4, f"{name}: *2")
                    check(((y * 2).placements == y.placements), f"{name}: *2 placements {(y * 2).placements}")


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
@pytest.mark.parametrize("kind", ["adamw_foreach", "adamw_loop", "adamw_fused"], ids=["foreach", "for-loop", "fused"])
def test_torch_adamw_on_the_dtensors_matches_the_reference(case, kind):
    """torch.optim.AdamW stepping the row-sharded DTensors directly, each implementation (the
    reference steps the same implementation on plain tensors)."""
    model, reference, _, _, losses, ref_losses = train_pair(Narrow, kind, microbatches=2, steps=3, **sharding(case))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=1e-6)
    compare_params(model, reference, grads=True)
