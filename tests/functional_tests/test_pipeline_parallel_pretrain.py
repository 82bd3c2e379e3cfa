"""pretrain_gpt.py end to end with pipeline parallelism: every layout gives the losses and
gradient norms of the unpipelined model on the same global batch, and checkpoints move
between pipeline layouts.

A GPT whose layers alternate dense and MoE (4 experts, top 2), fp32, no dropout, tied
embeddings (the word embedding then lives on the first and the last stage): initial global
weights do not depend on the layout (seeded per parameter name), every stage reads its
data-parallel rank's samples, and the loss is normalized over the global batch, so the runs
differ only by reduction order. Layouts: PP=2 x DP=2 with EP=2 (ZeRO-3), interleaved PP=2 x
2 virtual stages x TP=2 with sequence parallelism, PP=2 x HSDP with uneven stages; the
PP=2 checkpoint of iteration 2 resumed at PP=4 without MFSDP and at PP=1 (ZeRO-1)
continues the curve. Untied embeddings: interleaved PP=2 from an explicit layout string,
with a multi-token prediction depth on the last chunk (its `m`) and per-token loss.
"""

import pytest

from test_pretrain_gpt import MODEL_ARGS, SAVE, assert_same_curve, run_layouts

ITERS = 4
BASE = list(MODEL_ARGS)
for flag, value in (("--train-iters", str(ITERS)), ("--eval-interval", str(ITERS)), ("--eval-iters", "1"),
                    ("--num-layers", "4"), ("--micro-batch-size", "1"), ("--hidden-size", "32")):
    BASE[BASE.index(flag) + 1] = value
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--moe-layer-freq", "([0]*1+[1]*1)*2"]
GAUX = ["--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "0.1",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.01"]
UNTIED = ["--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
          "--mtp-num-layers", "1", "--calculate-per-token-loss"]

RUNS = {
    # name: (ranks, flags); "ref" runs are the unpipelined references
    "ref": (1, MOE + ["--use-mfsdp"]),
    "pp2-dp2-ep2": (4, MOE + ["--use-mfsdp", "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size",
                              "2", "--save", SAVE + "/pp2", "--save-interval", "2"]),
    "pp2-vp2-tp2-sp": (4, MOE + ["--use-mfsdp", "--pipeline-model-parallel-size", "2",
                                 "--num-layers-per-virtual-pipeline-stage", "1", "--tensor-model-parallel-size", "2",
                                 "--sequence-parallel"]),
    "pp2-hsdp-uneven": (4, MOE + ["--use-mfsdp", "--pipeline-model-parallel-size", "2",
                                  "--num-distributed-optimizer-instances", "2",
                                  "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3"]),
    "pp4-plain-resumed": (4, MOE + ["--pipeline-model-parallel-size", "4", "--load", SAVE + "/pp2/iter_0000002"]),
    "pp1-zero1-resumed": (2, MOE + ["--use-mfsdp", "--data-parallel-sharding-strategy", "optim",
                                    "--load", SAVE + "/pp2/iter_0000002"]),
    "ref-untied": (1, UNTIED + ["--use-mfsdp"]),
    # global_aux_loss's running mean and the expert-bias counts under 1F1B with full
    # recompute: each recompute (after the next micro-batch's forward) reuses its forward's.
    "ref-gaux": (1, MOE + GAUX + ["--use-mfsdp"]),
    "pp2-gaux-recompute": (2, MOE + GAUX + ["--use-mfsdp", "--pipeline-model-parallel-size", "2",
                                            "--recompute-granularity", "full"]),
    "pp2-vp2-layout-untied": (2, UNTIED + ["--use-mfsdp", "--pipeline-model-parallel-size", "2",
                                           "--pipeline-model-parallel-layout", "Et|t|t|tmL"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(BASE, RUNS, tmp_path_factory)


def _same_curve(runs, name, reference, first=1):
    assert_same_curve(runs, name, reference, ITERS, first)


def test_global_aux_loss_under_1f1b_with_recompute_gives_the_unpipelined_losses(runs):
    _same_curve(runs, "pp2-gaux-recompute", "ref-gaux")


@pytest.mark.parametrize("name", ["pp2-dp2-ep2", "pp2-vp2-tp2-sp", "pp2-hsdp-uneven"])
def test_pipeline_layouts_give_the_unpipelined_losses(runs, name):
    ref_train = runs["ref"][0]
    assert ref_train[ITERS]["lm_loss"] != ref_train[1]["lm_loss"]  # the model trained
    _same_curve(runs, name, "ref")


def test_untied_interleaved_layout_gives_the_unpipelined_losses(runs):
    _same_curve(runs, "pp2-vp2-layout-untied", "ref-untied")
    train, ref_train = runs["pp2-vp2-layout-untied"][0], runs["ref-untied"][0]
    for it in range(1, ITERS + 1):  # the MTP depth on the last stage, logged by rank 0
        assert train[it]["mtp_1_loss"] == pytest.approx(ref_train[it]["mtp_1_loss"], rel=1e-5), it
    assert "pipeline parallel 2 x 2 virtual stages (interleaved 1F1B)" in runs["pp2-vp2-layout-untied"][2]


@pytest.mark.parametrize("name", ["pp4-plain-resumed", "pp1-zero1-resumed"])
def test_pipeline_checkpoint_resumes_at_another_layout(runs, name):
    assert "resumed from" in runs[name][2]
    _same_curve(runs, name, "ref", first=3)


def test_the_log_line_names_the_layout_and_counts_every_parameter(runs):
    stdout = runs["pp2-dp2-ep2"][2]
    assert "pipeline parallel 2 (1F1B)" in stdout
    count = [line for line in runs["ref"][2].splitlines() if line.startswith("> model:")][0].split(" parameters")[0]
    assert count + " parameters" in stdout  # the stages' parameters add up to the model's, tied weight once
