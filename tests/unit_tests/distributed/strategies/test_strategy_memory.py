"""Per-rank persistent memory of every strategy, and meta-device initialization.

Per parameter group, with T = the group's element count, N = inner (sharding) axis size,
M = outer axis size, S = layout.shard_numel (ceil(T/N) <= S < ceil(T/N) + widest row),
So = HFSDP's outer shard of S (ceil(S/M) <= So), and b_main / b_model / b_grad the
element sizes of main_params_dtype / the compute dtype / main_grads_dtype
(``alias`` = compute dtype == main_params_dtype):

| strategy | main_weight  | model_weight              | main_grad           |
|----------|--------------|---------------------------|---------------------|
| no_shard | T * b_main   | 0 if alias else T*b_model | T * b_grad          |
| ZeRO-1   | S * b_main   | T * b_model               | (N*S + S) * b_grad  |
| ZeRO-2   | S * b_main   | T * b_model               | S * b_grad          |
| ZeRO-3   | S * b_main   | 0 if alias else S*b_model | S * b_grad          |
| HSDP     | S * b_main   | 0 if alias else S*b_model | S * b_grad          |
| HFSDP    | So * b_main  | S * b_model               | (S + So) * b_grad   |

ZeRO-1 keeps a full local accumulation buffer (N*S, the gathered layout) plus the
reduced shard S; HFSDP keeps the inner partial sum S plus the reduced outer shard So.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from _dist_helpers import batches, compare_params, local_rows, make_optimizer, wrap
from _strategy_common import Net, case_id, dtype_bytes, sharding, sizes, strategy_cases
from megatron.core.distributed.mfsdp_v2 import fully_shard_optimizer, microbatch

CASES = strategy_cases()
WIDEST_ROW = 12  # widest row in Net and MetaNet: the (12, 12) and (8, 12) weights


def expected_bytes(case, T, S, So, b_main, b_model, b_grad):
    name = case[0]
    outer, inner = sizes(case)
    alias = b_main == b_model  # every precision used here differs in size when it differs
    if name == "no_shard":
        return dict(main_weight=T * b_main, model_weight=0 if alias else T * b_model, main_grad=T * b_grad)
    if name == "zero1":
        return dict(main_weight=S * b_main, model_weight=T * b_model, main_grad=(inner * S + S) * b_grad)
    if name == "zero2":
        return dict(main_weight=S * b_main, model_weight=T * b_model, main_grad=S * b_grad)
    if name in ("zero3", "hsdp"):
        return dict(main_weight=S * b_main, model_weight=0 if alias else S * b_model, main_grad=S * b_grad)
    assert name == "hfsdp"
    return dict(main_weight=So * b_main, model_weight=S * b_model, main_grad=(S + So) * b_grad)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_persistent_bytes_match_formula(case, precision):
    cast = torch.bfloat16 if precision == "bf16" else None
    torch.manual_seed(0)
    model = Net()
    ctx = wrap(model, **sharding(case), cast=cast)
    opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    generator = torch.Generator().manual_seed(1)
    for i, (xb, yb) in enumerate(batches(generator, 2)):
        with microbatch(ctx, is_last=i == 1):
            F.mse_loss(model(local_rows(xb).to(cast or torch.float32)), local_rows(yb).to(cast or torch.float32)).backward()
    opt.step()

    outer, inner = sizes(case)
    b_main, b_model = 4, dtype_bytes(cast or torch.float32)
    b_grad = b_model  # main_grads_dtype defaults to the compute dtype
    shards = 1 if case[0] == "no_shard" else inner
    totals = dict(main_weight=0, model_weight=0, main_grad=0)
    for unit, shapes in zip(ctx.units, Net.unit_shapes()):
        (group,) = unit.parameter_groups
        T = sum(math.prod(s) for s in shapes)
        S = group.layout.shard_numel
        assert math.ceil(T / shards) <= S < math.ceil(T / shards) + WIDEST_ROW
        So = group.outer_layout.shard_numel if case[0] == "hfsdp" else None
        if So is not None:  # the outer split of this rank's inner shard (its used part)
            used = group.layout.used_numel(group.shard_index)
            assert math.ceil(used / outer) <= So < math.ceil(used / outer) + WIDEST_ROW
        want = expected_bytes(case, T, S, So, b_main, b_model, b_grad)
        assert group.persistent_bytes() == want, unit.name
        assert unit.persistent_bytes() == want
        # The figures describe real storage: the buffers hold exactly those bytes ...
        assert group.main_weight.untyped_storage().nbytes() == want["main_weight"]
        if case[0] in ("zero3", "hsdp", "hfsdp"):
            # ... and the unsharded compute weights hold none between steps.
            assert group.unsharded.untyped_storage().nbytes() == 0
            if want["model_weight"]:
                assert group.model_weight.untyped_storage().nbytes() == want["model_weight"]
            else:
                assert group.model_weight is group.main_weight
        elif want["model_weight"]:
            assert group.unsharded.untyped_storage().nbytes() == want["model_weight"]
        else:
            assert group.unsharded is group.main_weight
        for key in totals:
            totals[key] += want[key]
    assert ctx.persistent_bytes() == totals


# --------------------------------------------------------------------------------------
# Meta-device initialization
# --------------------------------------------------------------------------------------


class MetaNet(Net):
    """Every unit owns exactly one Linear, so ``reset_parameters`` order inside a unit
    cannot matter: units inp, blocks[0], blocks[1] and the root (which owns ``head``)."""

    def units(self):
        return [self.inp, self.blocks[0], self.blocks[1], self]

    def unit_linears(self):
        return [self.inp, self.blocks[0].lin, self.blocks[1].lin, self.head]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_meta_init_matches_reference(case):
    """Built on ``meta``, materialized sharded by fully_shard, initialized per unit by
    ``init_parameters()`` (the modules' own ``reset_parameters``): equal to a CPU reference
    initialized the same way, and training on from there matches it."""
    with torch.device("meta"):
        model = MetaNet()
    torch.manual_seed(0)
    reference = MetaNet()
    ctx = wrap(model, **sharding(case))
    for p in model.parameters():
        assert not p.is_meta and not p.to_local().is_meta
    sharded_weights = case[0] in ("zero3", "hsdp", "hfsdp")
    for k, (unit, linear) in enumerate(zip(model.units(), reference.unit_linears())):
        torch.manual_seed(100 + k)  # the same seed on every rank
        unit.init_parameters()
        torch.manual_seed(100 + k)
        linear.reset_parameters()
        if sharded_weights:  # nothing stays unsharded after init
            for g in unit.parameter_groups:
                assert g.unsharded.untyped_storage().nbytes() == 0
    compare_params(model, reference, grads=False, rtol=0, atol=0)

    opt = fully_shard_optimizer(make_optimizer("adamw", model.parameters()))
    ref_opt = make_optimizer("adamw", reference.parameters())
    generator = torch.Generator().manual_seed(2)
    for _ in range(2):
        mbs = batches(generator, 2)
        opt.zero_grad()
        ref_opt.zero_grad()
        F.mse_loss(reference(torch.cat([b[0] for b in mbs])), torch.cat([b[1] for b in mbs])).backward()
        for i, (xb, yb) in enumerate(mbs):
            with microbatch(ctx, is_last=i == 1):
                (F.mse_loss(model(local_rows(xb)), local_rows(yb)) / 2).backward()
        opt.step()
        ref_opt.step()
    compare_params(model, reference)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("zero3", "hsdp", "hfsdp")], ids=case_id)
def test_meta_init_never_materializes_the_whole_model(case):
    """During a unit's init only that unit is unsharded; afterwards each rank holds 1/N of
    the main weights (S per group, S < ceil(T/N) + widest row)."""
    with torch.device("meta"):
        model = MetaNet()
    ctx = wrap(model, **sharding(case))
    units = model.units()
    linear_of = dict(zip(units, model.unit_linears()))
    seen = []

    def init_fn(module):
        unsharded = [u for u in units for g in u.parameter_groups if g.unsharded.untyped_storage().nbytes() > 0]
        seen.append((module, unsharded))
        linear_of[module].reset_parameters()

    for k, unit in enumerate(units):
        torch.manual_seed(100 + k)
        unit.init_parameters(init_fn)
    assert [m for m, _ in seen] == units
    for module, unsharded in seen:
        assert unsharded == [module]
    # Per-rank main weights: one shard per group, about 1/N (1/(N*M) for HFSDP) of the model.
    outer, inner = sizes(case)
    expected_main, bound = 0, 0
    for unit in units:
        (group,) = unit.parameter_groups
        T = sum(p.numel() for p in linear_of[unit].parameters())
        S = group.layout.shard_numel
        assert math.ceil(T / inner) <= S < math.ceil(T / inner) + WIDEST_ROW
        expected_main += (group.outer_layout.shard_numel if case[0] == "hfsdp" else S) * 4
        bound += (math.ceil(T / inner) + WIDEST_ROW - 1) * 4
    assert ctx.persistent_bytes()["main_weight"] == expected_main <= bound
