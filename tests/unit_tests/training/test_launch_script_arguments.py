"""The flags of upstream's examples/ launch scripts (megatron/training/launch_script_arguments.py):
what each maps onto, the note lines of the GPU-only ones, the parse-time refusals."""

import pytest
import torch

from megatron.training.arguments import parse_args
from megatron.training.model_builder import build_mixed_precision_policy

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --lr 1e-3 "
        "--train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 128")


def parse(extra="", world_size=2):
    return parse_args((BASE + " " + extra).split(), world_size=world_size, cuda_available=False)


def test_grad_reduce_in_bf16_sets_the_engines_reduction_dtype():
    """The engine's reductions then run in bf16 into fp32 main_grad (its own test,
    test_grad_comm_dtype_is_honoured, checks that against a bf16 reference)."""
    policy = build_mixed_precision_policy(parse("--use-mfsdp --bf16 --grad-reduce-in-bf16"))
    assert (policy.grad_comm_dtype, policy.main_grads_dtype) == (torch.bfloat16, torch.float32)
    # Upstream's Llama-3 line: --use-distributed-optimizer (ZeRO-1 here) with the flag.
    assert parse("--use-distributed-optimizer --bf16 --grad-reduce-in-bf16").grad_comm_dtype == torch.bfloat16
    assert build_mixed_precision_policy(parse("--use-mfsdp --bf16")).grad_comm_dtype is None  # main_grads: fp32


def test_grad_reduce_in_bf16_notes_where_it_does_nothing(capsys):
    assert parse("--use-mfsdp --grad-reduce-in-bf16").grad_comm_dtype is None
    assert "no effect without --bf16" in capsys.readouterr().out
    parse("--bf16 --grad-reduce-in-bf16")
    assert "under DDP" in capsys.readouterr().out
    with pytest.raises(ValueError, match="pass one of them"):
        parse("--use-mfsdp --bf16 --grad-reduce-in-bf16 --megatron-fsdp-grad-comm-dtype fp32")


def test_megatron_fsdp_buffer_flags_are_one_note_each(capsys):
    parse("--use-mfsdp --fsdp-double-buffer --fsdp-manual-registration --use-nccl-ub")
    lines = [line for line in capsys.readouterr().out.splitlines() if "--fsdp-" in line]
    assert len(lines) == 2 and "at most two units' gathers" in lines[0] and "CUDA-only" in lines[1]
    assert "--use-nccl-ub and --fsdp-manual-registration" in lines[1]


def test_sc21_flags_are_todays_recompute_flags(capsys):
    args = parse("--activations-checkpoint-method uniform --DDP-impl local")
    assert (args.recompute_method, args.recompute_granularity) == ("uniform", "full")
    assert "--DDP-impl local" in capsys.readouterr().out
    with pytest.raises(ValueError, match="old name of --recompute-method"):
        parse("--activations-checkpoint-method uniform --recompute-method block")


def test_profile_flags(capsys, tmp_path):
    args = parse(f"--profile --use-pytorch-profiler --tensorboard-dir {tmp_path}")
    assert (args.profile_step_start, args.profile_step_end, args.profile_ranks) == (10, 12, [0])  # upstream's
    parse(f"--profile --tensorboard-dir {tmp_path}")
    assert "nsys capture range" in capsys.readouterr().out
    for extra, message in (("--profile --use-pytorch-profiler", "add --tensorboard-dir"),
                           ("--profile --profile-step-start 5 --profile-step-end 5", "below --profile-step-end"),
                           ("--profile --profile-ranks 0 2", "outside the world of 2 ranks")):
        with pytest.raises(ValueError, match=message):
            parse(extra)


def test_flash_attention_with_mla_head_dims_runs_the_math_kernel_on_cpu(capsys):
    """DeepSeek-V3's script: --use-flash-attn and MLA (q/k 24, v 16 here): CPU's flash kernel
    cannot take them, the unfused kernel runs (the same attention)."""
    mla = ("--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 32 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
           "--v-head-dim 16 --position-embedding-type rope --use-flash-attn --attention-dropout 0")
    assert parse(mla).attention_backend == "unfused"
    assert "equal q/k and v head dimensions" in capsys.readouterr().out
    assert parse("--use-flash-attn --attention-dropout 0").attention_backend == "flash"
