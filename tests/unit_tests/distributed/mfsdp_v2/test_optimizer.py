"""fully_shard_optimizer: compute weights follow the main weights; misuse raises."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from _dist_helpers import H, build_pair, local_rows, mesh_1d, world, wrap
from _mfsdp_models import Block, CASES, Nested, expected_local, gather_full, shard_infos
from megatron.core.distributed.mfsdp_v2 import (
    MixedPrecisionPolicy,
    Placements,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
)


def _somewhere(flag: bool) -> bool:
    """True on every rank if ``flag`` holds on at least one rank."""
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t)
    return t.item() > 0


def _backward(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * world(), H, generator=g)
    F.mse_loss(model(local_rows(x)), torch.zeros(2, H)).backward()


def test_optimizer_parameters_are_the_sharded_dtensors():
    model, _, ctx = build_pair(CASES["tied"].build)
    opt = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    params = [p for g in opt.param_groups for p in g["params"]]
    assert all(isinstance(p, DTensor) for p in params)
    # The tied weight is one optimizer parameter.
    assert sum(1 for p in params if p is model.emb.weight) == 1
    assert len(params) == len({id(p) for p in params})
    assert len(params) == sum(len(g.fsdp_parameters) for u in ctx.units for g in u.parameter_groups)


def test_sgd_step_updates_main_weight_by_minus_lr_times_grad():
    model, _, ctx = build_pair(CASES["nested"].build)
    opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    _backward(model)
    before = {i.name: i.param.to_local().clone() for i in shard_infos(model, ctx)}
    grads = {i.name: i.param.grad.to_local().clone() for i in shard_infos(model, ctx)}
    assert _somewhere(sum(float(g.abs().sum()) for g in grads.values()) > 0)  # premise: gradients exist
    opt.step()
    for info in shard_infos(model, ctx):
        torch.testing.assert_close(info.param.to_local(), before[info.name] - 0.5 * grads[info.name])
        # ...and the value lives in main_weight.
        main = info.group.main_weight.narrow(0, info.offset, info.param.to_local().numel())
        torch.testing.assert_close(main.view_as(info.param.to_local()), info.param.to_local(), rtol=0, atol=0)


def test_compute_weights_follow_the_main_weights_after_step():
    """bf16 compute weights with fp32 main weights: after step() the compute copy is the
    cast of the updated main weights, and the next unshard gathers exactly that."""
    torch.manual_seed(0)
    model = Nested().to(torch.bfloat16)
    with fully_shard_context(device="cpu") as ctx:
        for unit in model.units():
            fully_shard(unit, mesh=mesh_1d(), placements=Placements.zero3(),
                        mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype=torch.float32))
    groups = [g for u in ctx.units for g in u.parameter_groups]
    assert all(g.main_weight.dtype == torch.float32 for g in groups)
    assert all(g.model_weight.dtype == torch.bfloat16 and g.model_weight is not g.main_weight for g in groups)
    opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    x = torch.randn(2, H, dtype=torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    main_before = [g.main_weight.clone() for g in groups]
    opt.step()
    changed = [not torch.equal(g.main_weight, before) for g, before in zip(groups, main_before)]
    assert _somewhere(any(changed))  # premise: the step changed something (a rank may hold no rows)
    for g in groups:
        torch.testing.assert_close(g.model_weight, g.main_weight.to(torch.bfloat16), rtol=0, atol=0)
    # The gathered compute weight of a unit equals its rebuilt main weights, cast.
    infos = {i.name: i for i in shard_infos(model, ctx)}
    full_main = {n: gather_full(i.param.to_local(), i) for n, i in infos.items() if n.startswith("right.")}
    model.right.unshard()
    try:
        for name, full in full_main.items():
            compute = dict(model.right.named_parameters())[name[len("right."):]]
            assert not isinstance(compute, DTensor) and compute.dtype == torch.bfloat16
            torch.testing.assert_close(compute, full.to(torch.bfloat16), rtol=0, atol=0)
    finally:
        model.right.reshard()


def test_forward_after_step_uses_the_updated_weights():
    model, reference, ctx = build_pair(CASES["nested"].build)
    opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2 * world(), H, generator=g)
    F.mse_loss(reference(x), torch.zeros_like(x)).backward()
    F.mse_loss(model(local_rows(x)), torch.zeros(2, H)).backward()
    ref_opt.step()
    opt.step()
    with torch.no_grad():
        torch.testing.assert_close(model(local_rows(x)), local_rows(reference(x)))


def test_step_with_closure_raises():
    model, _, ctx = build_pair(CASES["nested"].build)
    opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    _backward(model)
    before = [p.to_local().clone() for p in model.parameters()]
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(lambda: torch.zeros(()))
    assert all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before))


def test_parameters_from_two_contexts_raise():
    a, b = Block(), Block()
    wrap(a, [a])
    wrap(b, [b])
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    with pytest.raises(ValueError, match="two fully_shard_contexts"):
        fully_shard_optimizer(opt)


def test_context_that_does_not_own_the_parameters_raises():
    a, b = Block(), Block()
    wrap(a, [a])
    ctx_b = wrap(b, [b])
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="does not own"):
        fully_shard_optimizer(opt, context=ctx_b)
    # The right context is accepted.
    fully_shard_optimizer(opt, context=a.context)


def test_plain_parameters_raise():
    plain = nn.Linear(H, H)
    with pytest.raises(ValueError, match="not a sharded parameter"):
        fully_shard_optimizer(torch.optim.SGD(plain.parameters(), lr=0.1))


def test_applying_twice_raises():
    model = Block()
    wrap(model, [model])
    opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already applied"):
        fully_shard_optimizer(opt)
