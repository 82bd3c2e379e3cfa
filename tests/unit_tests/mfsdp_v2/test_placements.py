"""Placements and MixedPrecisionPolicy validation (no process group needed)."""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from megatron.core.distributed.mfsdp_v2 import MixedPrecisionPolicy, Placements
from megatron.core.distributed.mfsdp_v2.mixed_precision import check_supported_dtype


def test_presets_have_one_placement_per_axis():
    for preset in (Placements.no_shard(), Placements.zero1(), Placements.zero2(), Placements.zero3()):
        assert len(preset.dp_axes) == 1
        assert len(preset.parameter) == len(preset.gradient) == len(preset.optimizer) == 1
    for preset in (Placements.hsdp(), Placements.hfsdp()):
        assert preset.dp_axes == (0, 1)
        assert len(preset.parameter) == len(preset.gradient) == len(preset.optimizer) == 2
    zero3 = Placements.zero3()
    assert zero3.parameter == (Shard(0),) and zero3.gradient == (Shard(0),) and zero3.optimizer == (Shard(0),)


def test_single_values_are_accepted_as_one_tuple():
    p = Placements(0, Shard(0), Shard(0), Shard(0))
    assert p.dp_axes == (0,) and p.parameter == (Shard(0),)


@pytest.mark.parametrize("field", ["parameter", "gradient", "optimizer"])
def test_lengths_must_match_dp_axes(field):
    kwargs = dict(dp_axes=(0,), parameter=(Shard(0),), gradient=(Shard(0),), optimizer=(Shard(0),))
    kwargs[field] = (Replicate(), Shard(0))
    with pytest.raises(ValueError, match=f"Placements.{field} has 2 placements but dp_axes has 1"):
        Placements(**kwargs)


def test_two_axes_with_one_placement_raise():
    with pytest.raises(ValueError, match="one placement per data-parallel axis"):
        Placements((0, 1), (Shard(0),), (Shard(0),), (Shard(0),))


def test_empty_or_repeated_axes_raise():
    with pytest.raises(ValueError, match="at least one"):
        Placements((), (), (), ())
    with pytest.raises(ValueError, match="names an axis twice"):
        Placements((0, 0), (Replicate(), Shard(0)), (Partial("avg"), Shard(0)), (Replicate(), Shard(0)))


def test_unknown_placement_raises():
    with pytest.raises(ValueError, match="Shard\\(0\\), Replicate\\(\\) or Partial"):
        Placements((0,), ("shard",), (Shard(0),), (Shard(0),))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.bool])
def test_unsupported_dtypes_say_what_is_supported(dtype):
    with pytest.raises(NotImplementedError, match="float32, bfloat16 and float16"):
        check_supported_dtype(dtype, "Parameter 'w'")
    with pytest.raises(NotImplementedError, match="float32, bfloat16 and float16"):
        MixedPrecisionPolicy(main_params_dtype=dtype)


def test_mixed_precision_rules():
    policy = MixedPrecisionPolicy()
    resolved = policy.resolve(torch.bfloat16)
    assert resolved.compute == torch.bfloat16
    assert resolved.main_params == torch.float32
    assert resolved.main_grads == torch.bfloat16  # None: the compute dtype
    assert resolved.grad_comm == torch.bfloat16  # None: main_grads_dtype
    assert not resolved.model_weight_aliases_main
    fp32 = policy.resolve(torch.float32)
    assert fp32.model_weight_aliases_main
    explicit = MixedPrecisionPolicy(main_grads_dtype=torch.float32, grad_comm_dtype=torch.bfloat16).resolve(torch.bfloat16)
    assert explicit.main_grads == torch.float32 and explicit.grad_comm == torch.bfloat16
