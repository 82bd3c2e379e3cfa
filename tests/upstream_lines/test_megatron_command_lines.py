"""Upstream Megatron-LM GPT command lines run here unchanged, apart from the CPU
substitutions (nccl -> gloo, transformer_engine -> local), tensor, context and expert
parallel sizes 1 (which turn --sequence-parallel off, as upstream does; the pipeline size
stays the line's own), paths into a temporary directory, mock data, and a model scaled
down to a tiny one.

upstream_gpt_configs.json holds the MODEL_ARGS of all upstream's GPT functional-test
configurations (source and commit inside; scripts/replay_upstream_configs.py counts how
many parse). Every one of the representative set TESTED must parse and validate; two of
them train 3 iterations at their pipeline sizes (1, 2 and 4 stages), and their
TensorBoard files hold the scalars the logging flags ask for.
"""

import glob
import json
import os
import sys

import pytest

from megatron.training.arguments import parse_args

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "functional_tests"))
import forked_launch  # noqa: E402
REPO = os.path.abspath(os.path.join(HERE, os.pardir, os.pardir))
CONFIGS = json.load(open(os.path.join(HERE, "upstream_gpt_configs.json")))["configs"]
TESTED = (
    "gpt3_mcore_te_tp1_pp1_dist_optimizer_no_mmap_bin_files", "gpt3_mcore_tp1_pp2_fp16",
    "gpt3_mcore_te_tp1_pp2_rope_embeddings", "gpt3_mcore_te_tp1_pp4_swiglu",
    "gpt3_mcore_te_tp1_pp4_untie_embeddings_and_outputs", "gpt3_mcore_te_tp1_pp4_disable_bias_linear",
    "gpt3_mcore_te_tp2_pp2_cp2_calculate_per_token_loss", "gpt3_mcore_te_tp2_pp2_cross_entropy_loss_fusion",
    "gpt3_mcore_te_tp2_pp2_no_create_attention_mask_in_dataloader",
    "gpt3_mcore_te_tp4_pp1_dist_optimizer_overlap_grad_reduce_param_gather",
    "gpt3_mcore_tp1_pp1_dist_optimizer_overlap_grad_reduce_param_gather",
    "gpt3_mcore_te_tp2_pp1_multi_dist_optimizer_instances", "gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor",
    "gpt3_mcore_te_tp1_pp4_sequence_parallel", "gpt3_mcore_te_tp2_pp1_fsdp2_resume_torch_dist",
    "gpt3_mcore_tp1_pp1_fsdp2_resume_torch_dist_te",
)

# Tiny CPU model and run length; everything else is the upstream value.
SCALE = {
    "--num-layers": 4, "--hidden-size": 64, "--num-attention-heads": 4, "--seq-length": 32,
    "--max-position-embeddings": 32, "--micro-batch-size": 2, "--global-batch-size": 8,
    "--train-iters": 3, "--eval-interval": 2, "--eval-iters": 1, "--ffn-hidden-size": 256,
    "--num-query-groups": 2, "--kv-channels": 16,
}
SUBSTITUTE = {"nccl": "gloo", "transformer_engine": "local"}
PARALLEL_SIZES = ("--tensor-model-parallel-size", "--context-parallel-size",
                  "--expert-model-parallel-size", "--expert-tensor-parallel-size")


def ranks_for(name) -> int:
    """2 ranks, or the line's pipeline size if larger."""
    return max(2, int(dict(CONFIGS[name]).get("--pipeline-model-parallel-size", 1)))


def command_line(name, tmp_path):
    from megatron.core.tokenizer import default_gpt2_vocab_files

    vocab, merges = default_gpt2_vocab_files()
    paths = {"${TENSORBOARD_PATH}": str(tmp_path / "tb"), "${CHECKPOINT_SAVE_PATH}": str(tmp_path / "ckpt"),
             "${CHECKPOINT_LOAD_PATH}": str(tmp_path / "ckpt"), "${DATA_CACHE_PATH}": str(tmp_path / "cache")}
    argv = []
    for flag, value in CONFIGS[name]:
        if flag == "--data-path":
            argv.append("--mock-data")
            continue
        if flag in ("--vocab-file", "--merge-file"):
            value = vocab if flag == "--vocab-file" else merges
        elif flag in SCALE:
            value = SCALE[flag]
        elif flag in PARALLEL_SIZES:
            value = 1
        elif isinstance(value, str):
            value = paths.get(value, SUBSTITUTE.get(value, value))
        if value is True:
            argv.append(flag)
        elif value is not False:
            argv += [flag, str(value)]
    return argv + ["--num-workers", "0"]


@pytest.mark.parametrize("name", TESTED)
def test_upstream_command_line_parses(name, tmp_path):
    args = parse_args(command_line(name, tmp_path), world_size=ranks_for(name), cuda_available=False)
    assert args.num_layers == 4 and args.distributed_backend == "gloo" and args.transformer_impl == "local"
    flags = {flag for flag, _ in CONFIGS[name]}
    if "--use-distributed-optimizer" in flags and "--use-megatron-fsdp" not in flags:
        # Upstream's DDP + distributed optimizer is ZeRO-1 on this engine.
        assert args.use_mfsdp and args.data_parallel_sharding_strategy == "optim"


def test_upstream_example_names_the_unsupported_flag(tmp_path):
    # examples/gpt3/train_gpt3_175b_distributed.sh uses a batch-size schedule (whose last batch is the global one).
    argv = command_line("gpt3_mcore_tp1_pp2_fp16", tmp_path)
    with pytest.raises(ValueError, match=r"pass only one of --step-batch-size-schedule and --global-batch-size"):
        parse_args(argv + ["--step-batch-size-schedule", "0:16 2.4B:320"], world_size=2, cuda_available=False)
    # Its PP=2 at CP=2 needs 4 ranks.
    with pytest.raises(ValueError, match=r"x --context-parallel-size \(2\) must divide the world size \(2\); launch a "
                                         r"multiple of 4 ranks"):
        parse_args(argv + ["--context-parallel-size", "2"], world_size=2, cuda_available=False)


def _tensorboard_tags(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))
    assert len(events) == 1, events
    acc = EventAccumulator(events[0])
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("name", ["gpt3_mcore_te_tp1_pp1_dist_optimizer_no_mmap_bin_files", "gpt3_mcore_tp1_pp2_fp16",
                                  "gpt3_mcore_te_tp1_pp4_untie_embeddings_and_outputs",
                                  "gpt3_mcore_te_tp2_pp1_fsdp2_resume_torch_dist"])  # PyTorch FSDP2, bf16
def test_upstream_command_line_trains_at_its_pipeline_size(name, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=REPO)
    # Its ranks forked from one process that imported the trainer once (forked_launch.py).
    proc = forked_launch.server().launch("pretrain_gpt.py", [*command_line(name, tmp_path), "--log-interval", "1"],
                                         nproc=ranks_for(name), env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-5000:]
    lines = [line for line in proc.stdout.splitlines() if " iteration " in line and "consumed samples" in line]
    assert len(lines) == 3
    if "fsdp2" in name:
        assert "PyTorch FSDP2" in proc.stdout
    assert all("num zeros: " in line and "params norm: " in line and "loss scale: " in line for line in lines)
    # Megatron's attention dropout keeps SDPA off its CPU flash kernel: rank 0 says so once.
    dropout = parse_args(command_line(name, tmp_path), world_size=ranks_for(name), cuda_available=False).attention_dropout
    notes = [line for line in proc.stdout.splitlines() if line.startswith("NOTE: attention runs in SDPA's math kernel")]
    assert len(notes) == (1 if dropout > 0 else 0) and (not notes or "--attention-dropout 0" in notes[0]), notes
    tags = _tensorboard_tags(str(tmp_path / "tb"))
    for tag in ("num-zeros", "params-norm", "iteration-time", "mem-rss-bytes", "mem-max-rss-bytes",
                "lm loss validation ppl", "grad-norm", "lm-loss"):
        assert tag in tags, sorted(tags)
    assert all(v > 0 for v in tags["params-norm"]) and all(v >= 0 for v in tags["num-zeros"])
    if "fp16" in name:
        assert "loss-scale" in tags and tags["loss-scale"][0] <= 2.0**32
    assert os.path.isfile(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt")
