"""Megatron's pipeline flags: what they set, and every parse-time error with its fix."""

import pytest

from megatron.training.arguments import parse_args
from megatron.training.pipeline_arguments import pipeline_layout_from_args

BASE = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
        "--lr 1e-3 --train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 128")


def parse(extra="", world_size=4):
    return parse_args((BASE + " " + extra).split(), world_size=world_size, cuda_available=False)


def test_pipeline_sizes_and_virtual_stages():
    args = parse("--pipeline-model-parallel-size 2 --global-batch-size 4")
    assert (args.data_parallel_size, args.num_microbatches, args.virtual_pipeline_model_parallel_size) == (2, 2, None)
    args = parse("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 --global-batch-size 4")
    assert args.virtual_pipeline_model_parallel_size == 2
    assert pipeline_layout_from_args(args).layers_of(1, 1) == (6, 7)
    for flag in ("--num-virtual-stages-per-pipeline-rank 4", "--virtual-pipeline-model-parallel-size 4"):
        args = parse(f"--pipeline-model-parallel-size 2 {flag} --global-batch-size 4")
        assert args.virtual_pipeline_model_parallel_size == 4
    args = parse("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ettt|t|tt|ttL --global-batch-size 4")
    assert args.virtual_pipeline_model_parallel_size == 2
    assert pipeline_layout_from_args(args).layers_of(0, 1) == (4, 5)
    # Upstream's MTP symbol: the depths close the last chunk (they are not decoder layers).
    args = parse("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*4|t*3|t|mmL --mtp-num-layers 2 "
                 "--position-embedding-type rope --global-batch-size 4")
    assert args.virtual_pipeline_model_parallel_size == 2
    assert [pipeline_layout_from_args(args).layers_of(r, 1) for r in (0, 1)] == [(7,), ()]
    # Accepted for upstream's command lines; the p2p streams always post receives ahead.
    args = parse("--pipeline-model-parallel-size 4 --no-overlap-p2p-communication "
                 "--overlap-p2p-communication-warmup-flush", world_size=4)
    assert args.overlap_p2p_comm is False and args.data_parallel_size == 1


@pytest.mark.parametrize("extra,world,match", [
    ("--pipeline-model-parallel-size 0", 4, "must be at least 1"),
    ("--pipeline-model-parallel-size 3", 4, r"x --pipeline-model-parallel-size \(3\) must divide the world size \(4\)"),
    ("--decoder-first-pipeline-num-layers 2", 4, "need --pipeline-model-parallel-size > 1; drop it"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 "
     "--num-virtual-stages-per-pipeline-rank 2", 4, "pass at most one of"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3", 4,
     r"must divide the layers per pipeline stage \(8 / 2\)"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 "
     "--decoder-first-pipeline-num-layers 2", 4, "give the virtual stages as --num-virtual-stages-per-pipeline-rank"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ett|ttL "
     "--decoder-last-pipeline-num-layers 2", 4, "places every layer itself"),
    ("--pipeline-model-parallel-size 4 --num-layers 6", 4, r"--num-layers = 6 must be divisible"),
    ("--pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split", 4,
     r"\(\+1 for the embedding\) = 9 must be divisible"),
    ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 3",
     4, "must split evenly"),
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 2", 4,
     r"must lie in \[pipeline size 2, microbatches 1\]"),
    ("--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 "
     "--num-virtual-stages-per-pipeline-rank 4", 4, "disagree"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Etttt|ttttmL", 4,
     r"places 1 multi-token prediction depths \(m\), --mtp-num-layers is 0"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Etttt|ttttmL --mtp-num-layers 2 "
     "--position-embedding-type rope", 4, r"places 1 multi-token prediction depths \(m\), --mtp-num-layers is 2"),
    ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ettttm|ttttL --mtp-num-layers 1 "
     "--position-embedding-type rope", 4, "end the layout with 'mL'"),
])
def test_pipeline_parse_errors(extra, world, match):
    with pytest.raises(ValueError, match=match):
        parse(extra, world_size=world)
