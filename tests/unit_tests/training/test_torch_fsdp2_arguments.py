"""--use-torch-fsdp2 at parse time: what it composes with, and one-line refusals (saying
what to do) for what it does not."""

import pytest
import torch

from megatron.training.arguments import parse_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --lr 1e-3 "
        "--train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --use-torch-fsdp2")


def parse(extra="", world_size=4):
    return parse_args((BASE + " " + extra).split(), world_size=world_size, cuda_available=False)


def test_accepted_with_upstreams_companions():
    args = parse("--ckpt-format torch_dist --untie-embeddings-and-output-weights --tensor-model-parallel-size 2 "
                 "--bf16 --torch-fsdp2-no-reshard-after-forward")
    assert args.use_torch_fsdp2 and not args.use_mfsdp
    assert args.params_dtype == torch.float32 and args.autocast_dtype is None  # bf16 via its MixedPrecisionPolicy
    assert args.torch_fsdp2_reshard_after_forward is False
    assert parse().torch_fsdp2_reshard_after_forward is True
    assert parse("--ckpt-format torch_dcp").ckpt_format == "torch_dcp"
    with pytest.raises(ValueError, match=r"--ckpt-format torch_dcp goes with --use-torch-fsdp2 \(as upstream\); add it"):
        parse_args((BASE.replace(" --use-torch-fsdp2", "") + " --ckpt-format torch_dcp").split(), world_size=2,
                   cuda_available=False)
    fp16 = parse("--fp16")  # upstream's fsdp2 functional-test line runs fp16 (its parser refuses it)
    assert fp16.params_dtype == torch.float32 and fp16.autocast_dtype is None


@pytest.mark.parametrize("extra, says", [
    ("--use-mfsdp", "drop --use-mfsdp or --use-torch-fsdp2"),
    ("--use-distributed-optimizer", "drop --use-distributed-optimizer"),
    ("--pipeline-model-parallel-size 2", "use --use-mfsdp for pipeline parallelism"),
    ("--context-parallel-size 2", "use --use-mfsdp for context parallelism"),
    ("--num-distributed-optimizer-instances 2", "use --use-mfsdp for HSDP"),
    ("--data-parallel-sharding-strategy optim", "drop them"),
    ("--optimizer muon", "use --use-mfsdp"),
    ("--num-experts 4 --expert-model-parallel-size 2", "use --use-mfsdp for expert parallelism"),
])
def test_refused_with_what_to_do(extra, says):
    with pytest.raises(ValueError) as error:
        parse(extra)
    message = str(error.value)
    assert "--use-torch-fsdp2 with" in message and says in message and "\n" not in message
