"""--optimizer muon and upstream's --muon-* flags: defaults, the dist_muon synonym, what
reaches the optimizer, and the parse-time refusals (one line each, saying what to do)."""

import types

import pytest

from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.model_builder import MUON_FIELDS, build_optimizer

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --lr 1e-3 "
        "--train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --optimizer muon")


def parse(extra="", world_size=1):
    return parse_args((BASE + " " + extra).split(), world_size=world_size, cuda_available=False)


def test_defaults_are_upstreams():
    args = parse()
    assert (args.muon_momentum, args.muon_nesterov, args.muon_split_qkv) == (0.9, False, True)
    assert (args.muon_scale_mode, args.muon_fp32_matmul_prec, args.muon_coefficient_type) == ("spectral", "medium",
                                                                                              "quintic")
    assert (args.muon_num_ns_steps, args.muon_tp_mode, args.muon_extra_scale_factor) == (5, "duplicated", 1.0)
    assert args.muon_scalar_optimizer == "adam" and args.muon_use_syrk is False
    flipped = parse("--muon-no-split-qkv --muon-nesterov --muon-use-syrk")
    assert (flipped.muon_split_qkv, flipped.muon_nesterov, flipped.muon_use_syrk) == (False, True, True)


def test_dist_muon_is_muon_with_the_distributed_optimizer(capsys):
    args = parse_args((BASE.replace("--optimizer muon", "--optimizer dist_muon")).split(), world_size=2,
                      cuda_available=False)
    assert args.optimizer == "muon" and args.use_mfsdp and args.data_parallel_sharding_strategy == "optim"
    assert "dist_muon is deprecated" in capsys.readouterr().out


def test_the_flags_reach_the_optimizer():
    import torch

    from megatron.core.optimizer.muon import Muon

    args = parse("--muon-momentum 0.8 --muon-nesterov --muon-num-ns-steps 8 --muon-coefficient-type polar_express "
                 "--muon-scale-mode unit_rms_norm --muon-extra-scale-factor 0.2 --muon-tp-mode blockwise "
                 "--muon-fp32-matmul-prec high")
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))
    built = types.SimpleNamespace(unwrapped=model, use_mfsdp=False)
    args.lr_warmup_samples, args.lr_decay_samples = 0, 10
    optimizer, _ = build_optimizer(args, built)
    assert isinstance(optimizer, Muon) and set(MUON_FIELDS) <= set(vars(args))
    muon_group = next(g for g in optimizer.param_groups if g["use_muon"])
    assert muon_group["momentum"] == 0.8 and muon_group["nesterov"] is True
    assert (optimizer.ns_steps, optimizer.coefficient_type, optimizer.scale_mode) == (8, "polar_express",
                                                                                      "unit_rms_norm")
    assert (optimizer.extra_scale_factor, optimizer.tp_mode, optimizer.precision) == (0.2, "blockwise", "high")


@pytest.mark.parametrize("extra,message", [
    ("--fp16", "does not support --fp16"),
    ("--muon-scalar-optimizer lion", "use adam"),
    ("--muon-fp32-matmul-prec low", "use medium or high"),
    ("--muon-coefficient-type custom", "is not known"),
    ("--muon-coefficient-type cubic5 --muon-num-ns-steps 6", "fixed 5-step"),
    ("--muon-num-ns-steps 0", "at least 1"),
    ("--muon-momentum 1.0", "must be in [0, 1)"),
])
def test_refusals(extra, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")) as error:
        parse(extra)
    assert "\n" not in str(error.value)


def test_hsdp_and_hfsdp_are_accepted():
    for extra in ("", " --outer-dp-sharding-strategy optim"):
        args = parse("--use-mfsdp --num-distributed-optimizer-instances 2" + extra, world_size=4)
        assert args.optimizer == "muon" and args.dp_outer_size == 2


def test_unknown_choices_are_argparse_errors():
    with pytest.raises(ArgumentError):
        parse("--muon-scale-mode rms")
    with pytest.raises(ArgumentError):
        parse("--muon-tp-mode gathered")
