"""pretrain_gpt.py with a mixture of experts under context parallelism: CP=2 x DP=2 with
EP=4 (ZeRO-3) and CP=2 x HSDP (2 instances) with EP=2 at 4 ranks train like CP=1 / EP=1
at 2 ranks (DP=2); CP=2 x TP=2 with sequence parallelism and EP=2 at 4 ranks (DP=1) like
CP=1 / TP=1 / EP=1 on one rank (the router's counts summed over CP and TP together).

Each CP rank routes its own 2 of the 4 chunks of every sequence; the expert layout counts
CP ranks as data-parallel ranks (EP=4 exchanges tokens across DP and CP ranks, EP=2 within
the CP pair of one data-parallel rank). The router statistics are the whole sequences'
(aux_loss and seq_aux_loss counts summed over CP, global_aux_loss and the expert-bias counts
over DP x CP), each rank's loss its tokens' share with the factor CP in backward, so the
losses, the gradient norms, the router losses and the token loads equal the CP=1 run's
(fp32, no dropout, dropless; sigmoid scores with the expert bias, whose update changes the
routing from iteration 2 on). The HSDP run also covers CP x HSDP for the dense units.
"""

import pytest

from test_pretrain_gpt import MODEL_ARGS, assert_same_curve, run_layouts

ITERS = 3
BASE = list(MODEL_ARGS)
for flag, value in (("--train-iters", str(ITERS)), ("--eval-interval", str(ITERS)), ("--eval-iters", "1")):
    BASE[BASE.index(flag) + 1] = value
BASE += ["--use-mfsdp", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
         "--moe-router-score-function", "sigmoid",
         "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "global_aux_loss",
         "--moe-aux-loss-coeff", "0.1", "0.1", "0.1", "--moe-z-loss-coeff", "0.01",
         "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05"]

RUNS = {
    # name: (ranks, flags)
    "ref": (2, []),
    "cp2-dp2-ep4": (4, ["--context-parallel-size", "2", "--expert-model-parallel-size", "4"]),
    "cp2-hsdp2-ep2": (4, ["--context-parallel-size", "2", "--expert-model-parallel-size", "2",
                          "--num-distributed-optimizer-instances", "2", "--cp-comm-type", "all_gather"]),
    "ref-dp1": (1, []),
    "cp2-tp2-sp-ep2": (4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                           "--expert-model-parallel-size", "2", "--cp-comm-type", "a2a"]),
}
ROUTER_METRICS = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(BASE, RUNS, tmp_path_factory)


@pytest.mark.parametrize("name,reference", [("cp2-dp2-ep4", "ref"), ("cp2-hsdp2-ep2", "ref"),
                                            ("cp2-tp2-sp-ep2", "ref-dp1")])
def test_moe_under_context_parallel_gives_the_cp1_run(runs, name, reference):
    ref, train = runs[reference][0], runs[name][0]
    assert ref[ITERS]["lm_loss"] != ref[1]["lm_loss"]  # the model trained
    assert_same_curve(runs, name, reference, ITERS)
    for it in range(1, ITERS + 1):
        for metric in ROUTER_METRICS:
            assert train[it][metric] == pytest.approx(ref[it][metric], rel=1e-5), (name, it, metric)
        for layer in (1, 2):
            for load in ("max_tokens_per_expert", "mean_tokens_per_expert"):
                key = f"moe/layer{layer}/{load}"
                assert train[it][key] == ref[it][key], (name, it, key)  # counted once per token
    # The whole micro-batch of the world: DP ranks x 2 sequences x 32 tokens, top-2 of 4 experts.
    dp = 1 if reference == "ref-dp1" else 2
    assert train[1]["moe/layer1/mean_tokens_per_expert"] == dp * 2 * 32 * 2 / 4
    assert "context parallel 2 (" in runs[name][2]
