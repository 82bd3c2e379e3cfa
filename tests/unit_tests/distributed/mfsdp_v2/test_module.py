"""Unit lifecycle (``FsdpModule.Phase``), profiler ranges, and the user-facing gaps of
issue 10: frozen parameters needed late in a unit's backward, ``dp_axes`` naming one
axis twice, a plain optimizer on a mixed-precision model, step hooks."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

from megatron.core.distributed.mfsdp_v2 import (
    FsdpModule,
    MixedPrecisionPolicy,
    Placements,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
)

from _dist_helpers import H, global_mean, local_rows, mesh_1d, world, wrap
from _mfsdp_models import Checkpointed, Nested

Phase = FsdpModule.Phase


def _units(model):
    return [m for m in model.modules() if isinstance(m, FsdpModule)]


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_phases_through_a_step_with_recompute(use_reentrant):
    torch.manual_seed(0)
    model = Checkpointed(use_reentrant)
    wrap(model, model.units())
    seen = {"forward": set(), "backward": set()}
    for unit in _units(model):
        unit.register_forward_pre_hook(lambda m, i: seen["forward"].add(m.phase))
    leaf = model.blocks[0]
    x = torch.randn(4, H, requires_grad=True)
    out = model(x)
    assert all(u.phase is Phase.RESTING for u in _units(model))
    # A hook on the first unit's input gradient runs after that unit's backward.
    x.register_hook(lambda g: seen["backward"].add(leaf.phase))
    out.sum().backward()
    assert Phase.FORWARD in seen["forward"] and seen["forward"] <= {Phase.FORWARD, Phase.BACKWARD}  # recomputation runs inside BACKWARD
    assert seen["backward"] <= {Phase.POST_BACKWARD}
    assert all(u.phase is Phase.RESTING for u in _units(model)), [u.phase for u in _units(model)]
    model(x).sum().backward()  # and again
    assert all(u.phase is Phase.RESTING for u in _units(model))


def test_invalid_transition_is_refused_with_a_clear_error():
    torch.manual_seed(0)
    model = Nested()
    wrap(model, model.units())
    state = model.left._fsdp_state
    with pytest.raises(RuntimeError, match="invalid phase transition RESTING -> RESTING"):
        state.phase = Phase.RESTING


class _FrozenNormBlock(nn.Module):
    """A transformer-style unit whose first LayerNorm is frozen and whose Linear trains:
    the Linear's weight gradient arrives before the LayerNorm's input gradient is computed."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.lin = nn.Linear(H, H)
        for p in self.norm.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return x + self.lin(self.norm(x))


class _FrozenNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.blocks = nn.ModuleList([_FrozenNormBlock(), _FrozenNormBlock()])

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x

    def units(self):
        return [self.blocks[0], self.blocks[1], self]


def test_frozen_parameters_stay_gathered_until_the_units_backward_is_over():
    torch.manual_seed(0)
    model = _FrozenNormNet()
    with torch.no_grad():  # a non-trivial frozen affine, so its gradient path matters
        for block in model.blocks:
            block.norm.weight.uniform_(0.5, 1.5)
    reference = copy.deepcopy(model)
    wrap(model, model.units())
    x = torch.randn(2 * world(), H, generator=torch.Generator().manual_seed(1))
    loss = model(local_rows(x)).square().mean()
    loss.backward()
    reference(x).square().mean().backward()
    torch.testing.assert_close(global_mean(loss), reference(x).square().mean().detach(), rtol=1e-5, atol=1e-6)
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if ref[name].requires_grad:
            torch.testing.assert_close(param.grad.full_tensor(), ref[name].grad, rtol=1e-4, atol=1e-6)
    for block in model.blocks:  # resharded by the end of backward
        assert all(g.unsharded.untyped_storage().size() == 0 for g in block.parameter_groups)


def test_dp_axes_naming_one_axis_twice_is_a_value_error():
    model = nn.Linear(H, H)
    hsdp = Placements.hsdp()
    placements = Placements((0, "dp"), hsdp.parameter, hsdp.gradient, hsdp.optimizer)  # dim 0 twice
    named = init_device_mesh("cpu", (world(),), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match="more than once"):
        with fully_shard_context(device="cpu"):
            fully_shard(model, mesh=named, placements=placements)
    assert not isinstance(model, FsdpModule)


@pytest.mark.parametrize("strategy", ["zero3", "zero2"])
def test_plain_optimizer_on_mixed_precision_model_updates_the_model(strategy):
    """bf16 compute, fp32 main weights: a torch optimizer without fully_shard_optimizer
    must change the model's outputs exactly like one with it."""
    outputs = []
    for hooked in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H)).to(torch.bfloat16)
        policy = MixedPrecisionPolicy(main_params_dtype=torch.float32)
        with fully_shard_context(device="cpu"):
            fully_shard(model, mesh=mesh_1d(), placements=getattr(Placements, strategy)(), mixed_precision_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        if hooked:
            fully_shard_optimizer(opt)
        x = torch.randn(2, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        before = model(x).detach()
        F.mse_loss(model(x).float(), torch.ones(2, H)).backward()
        opt.step()
        after = model(x).detach()
        assert not torch.equal(before, after), "the optimizer step did not reach the compute weights"
        outputs.append(after)
    assert torch.equal(outputs[0], outputs[1])


def test_fully_shard_optimizer_uses_step_hooks_and_syncs_once_per_group():
    torch.manual_seed(0)
    model = Nested()
    wrap(model, model.units())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = opt.step
    fully_shard_optimizer(opt)
    assert opt.step == step  # not replaced on the instance
    calls = []
    for unit in _units(model):
        for group in unit.parameter_groups:
            original = group.sync_model_weight_from_main_weight
            group.sync_model_weight_from_main_weight = lambda original=original: (calls.append(1), original())
    model(torch.randn(2, H)).sum().backward()
    opt.step()
    assert len(calls) == sum(len(u.parameter_groups) for u in _units(model))
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(lambda: 0.0)


def test_an_unrelated_optimizer_never_reaches_the_engine():
    """The engine registers no process-wide optimizer hook: stepping an optimizer over
    other parameters runs none of its code, and a plain optimizer over its parameters is
    seen at the next unshard only (the main weights' version counter)."""
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    hooks_before = (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks))
    torch.manual_seed(0)
    model = Nested()
    wrap(model, model.units())
    opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == hooks_before
    calls = []
    for unit in _units(model):
        for group in unit.parameter_groups:
            original = group.weights.sync_model_weight  # every refresh runs it (weight_sync.py)
            group.weights.sync_model_weight = lambda original=original: (calls.append(1), original())[1]
    other = nn.Linear(H, H)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    for _ in range(3):
        other(torch.randn(2, H)).sum().backward()
        other_opt.step()
    model(torch.randn(2, H)).sum().backward()
    assert calls == [], "an unrelated optimizer's step (or a forward after none of ours) refreshed the weights"
    opt.step()
    synced = len(calls)
    assert synced == sum(len(u.parameter_groups) for u in _units(model))
    model(torch.randn(2, H))  # ours already refreshed: nothing more at the next unshard
    assert len(calls) == synced


def test_profiler_ranges_name_every_hook_of_every_unit():
    torch.manual_seed(0)
    model = Nested()
    wrap(model, model.units())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.randn(2, H)).sum().backward()
    names = [e.name for e in prof.events() if e.name.startswith("MFSDP ")]
    labels = ["<root>" if not u.name else u.name for u in _units(model)]
    for label in labels:
        for hook in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
            assert names.count(f"MFSDP {label} {hook}") == 1, (label, hook, names)
    assert names.count("MFSDP finish_backward") == 1
