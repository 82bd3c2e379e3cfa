"""pretrain_gpt.py end to end with context parallelism: every layout gives the losses and
gradient norms of the CP=1 model on the same global batch, and a CP checkpoint resumes at CP=1.

A Llama-style GPT (RoPE, GQA with 2 query groups for 4 heads, SwiGLU, RMSNorm, untied
embeddings), fp32, no dropout, mock data. The CP ranks of a data-parallel rank read the
same samples and keep their 2 of the 2*cp chunks; the engine averages gradients over
dp x cp and the loss is normalized over the whole global batch, so the runs differ only by
reduction order. Layouts: CP=2 x DP=2 (p2p, ZeRO-3), CP=4 with one type per layer
(all_gather, then a2a+p2p as 2 x 2), CP=2 x TP=2 with sequence parallelism (DDP),
CP=2 x PP=2 with a2a (Ulysses) and --calculate-per-token-loss (the schedule's
normalization; the others use Megatron's default per-microbatch mean). The CP=2 x DP=2 checkpoint of iteration 2 resumed
on one rank continues the curve.
"""

import pytest

from test_pretrain_gpt import MODEL_ARGS, SAVE, assert_same_curve, run_layouts

ITERS = 3
BASE = list(MODEL_ARGS)
for flag, value in (("--train-iters", str(ITERS)), ("--eval-interval", str(ITERS)), ("--eval-iters", "1"),
                    ("--hidden-size", "32")):
    BASE[BASE.index(flag) + 1] = value
BASE += ["--position-embedding-type", "rope", "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
         "--untie-embeddings-and-output-weights"]

RUNS = {
    # name: (ranks, flags)
    "ref": (1, ["--use-mfsdp"]),
    "cp2-dp2-p2p": (4, ["--use-mfsdp", "--context-parallel-size", "2", "--save", SAVE + "/cp2",
                        "--save-interval", "2"]),
    "cp4-all_gather-a2a+p2p": (4, ["--use-mfsdp", "--context-parallel-size", "4", "--cp-comm-type", "all_gather",
                                   "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"]),
    "cp2-tp2-sp-ddp": (4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "cp2-pp2-a2a-per-token": (4, ["--use-mfsdp", "--context-parallel-size", "2", "--pipeline-model-parallel-size",
                                  "2", "--cp-comm-type", "a2a", "--calculate-per-token-loss"]),
    "cp1-resumed": (1, ["--use-mfsdp", "--load", SAVE + "/cp2/iter_0000002"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(BASE, RUNS, tmp_path_factory)


def _same_curve(runs, name, first=1):
    assert_same_curve(runs, name, "ref", ITERS, first)


@pytest.mark.parametrize("name", ["cp2-dp2-p2p", "cp4-all_gather-a2a+p2p", "cp2-tp2-sp-ddp", "cp2-pp2-a2a-per-token"])
def test_context_parallel_layouts_give_the_cp1_losses(runs, name):
    ref_train = runs["ref"][0]
    assert ref_train[ITERS]["lm_loss"] != ref_train[1]["lm_loss"]  # the model trained
    _same_curve(runs, name)
    size = 4 if name.startswith("cp4") else 2
    assert f"context parallel {size} (" in runs[name][2]


def test_context_parallel_checkpoint_resumes_at_cp1(runs):
    assert "resumed from" in runs["cp1-resumed"][2]
    _same_curve(runs, "cp1-resumed", first=3)
