"""pretrain_gpt.py with a mixture of experts: TP=2 x EP=2 at 4 ranks trains like TP=1/EP=1
at 2 ranks.

At 4 ranks with TP=2 the data-parallel size is 2, as at 2 ranks without TP: the same
micro-batches, each expert split over the TP pair, each TP rank exchanging tokens with
its EP partner of the same TP rank. Same seed, same global batch (8), fp32, dropless: the
initial weights are the same global tensors at every layout, so the loss curves agree to
reduction order. The log line and metrics.jsonl carry the MoE metrics, counted once per
token. (EP=2 without TP at 4 ranks is covered by the unit tests.)
"""

import pytest
import torch

from test_pretrain_gpt import MODEL_ARGS, read_metrics, run_ranks

ITERS = 4
ARGS = list(MODEL_ARGS)
ARGS[ARGS.index("--train-iters") + 1] = str(ITERS)
ARGS[ARGS.index("--eval-interval") + 1] = str(ITERS)
MOE = ["--use-mfsdp", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64"]


def run(tmp_path, name, nproc, *flags):
    log_dir = tmp_path / name
    proc = run_ranks(ARGS + MOE + list(flags) + ["--log-dir", str(log_dir)], nproc=nproc)
    train, _ = read_metrics(str(log_dir))
    return train, proc.stdout


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """EP=1 at 2 ranks; TP=2 x EP=2 at 4 ranks, saving at iteration 2."""
    tmp_path = tmp_path_factory.mktemp("moe")
    ep1, _ = run(tmp_path, "ep1", 2)
    save = tmp_path / "ckpt"
    ep2, log = run(tmp_path, "tp2-ep2", 4, "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                   "--save", str(save), "--save-interval", "2")
    return ep1, ep2, log, save


def test_tp2_ep2_at_4_ranks_matches_ep1_at_2_ranks(layouts):
    ep1, ep2, log, _ = layouts
    curve1 = [ep1[i]["lm_loss"] for i in range(1, ITERS + 1)]
    curve2 = [ep2[i]["lm_loss"] for i in range(1, ITERS + 1)]
    assert curve2 == pytest.approx(curve1, rel=2e-5)
    assert [ep2[i]["grad_norm"] for i in range(1, ITERS + 1)] == pytest.approx(
        [ep1[i]["grad_norm"] for i in range(1, ITERS + 1)], rel=1e-4)
    assert len(set(curve1)) == ITERS  # a real curve, not one value repeated
    assert "tensor parallel 2 x data parallel 2" in log
    # Token load per layer, counted once per token (not once per TP rank): a micro-batch of
    # the data-parallel world is 2 ranks x 2 x 32 tokens, top-2 of 4 experts; the routing is EP=1's.
    for layer in (1, 2):
        assert ep2[1][f"moe/layer{layer}/mean_tokens_per_expert"] == pytest.approx(2 * 2 * 32 * 2 / 4)
        assert ep2[1][f"moe/layer{layer}/max_tokens_per_expert"] == ep1[1][f"moe/layer{layer}/max_tokens_per_expert"]
    assert "tokens per expert max/mean: layer1 " in log


def test_router_losses_and_dropped_tokens_are_logged(tmp_path):
    train, log = run(tmp_path, "drop", 2, "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0.01",
                     "--moe-z-loss-coeff", "0.001", "--moe-expert-capacity-factor", "0.5")
    first = train[1]
    # Near-uniform routing at initialization: the load-balancing loss is ~1, the z-loss ~ln(4)^2.
    assert first["load_balancing_loss"] == pytest.approx(1.0, abs=0.05)
    assert first["z_loss"] == pytest.approx(1.3863 ** 2, rel=0.05)
    # Capacity ceil(64 * 2 / 4 * 0.5) = 16 of 64 x 2 assignments per rank and layer: at least 64 dropped each.
    assert first["moe_dropped_tokens"] >= 2 * 2 * 64
    assert "load_balancing_loss: " in log and "z_loss: " in log and "dropped tokens: " in log


def test_checkpoint_saved_at_tp2_ep2_resumes_at_tp1_ep1(layouts, tmp_path):
    """Experts are stored as global tensors by global index (weights and Adam state): the
    TP=2 x EP=2 run's checkpoint of iteration 2 resumes at TP=1/EP=1 on 2 ranks exactly
    where the TP=2 x EP=2 run went on."""
    _, ep2, _, save = layouts
    resumed, log = run(tmp_path, "resumed", 2, "--load", str(save / "iter_0000002"))
    assert "resumed from" in log
    for it in (3, 4):
        assert resumed[it]["lm_loss"] == pytest.approx(ep2[it]["lm_loss"], rel=2e-5)


ROUTER = ["--expert-model-parallel-size", "2", "--moe-router-score-function", "sigmoid",
          "--moe-router-load-balancing-type", "seq_aux_loss", "global_aux_loss",
          "--moe-aux-loss-coeff", "0.01", "0.001",
          "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01"]


def test_expert_bias_is_updated_by_the_trainer_saved_and_resumed(tmp_path):
    """EP=2 with seq_aux_loss + global_aux_loss and the expert bias: the trainer's optimizer
    step updates the bias (no call in the training loop), the checkpoint holds it under
    Megatron's name, and a run resumed from iteration 2 goes on exactly (it would route
    differently with a lost bias)."""
    from megatron.core.distributed.mfsdp_v2.checkpoint import load_tensors

    save = tmp_path / "ckpt"
    full, log = run(tmp_path, "full", 2, *ROUTER, "--save", str(save), "--save-interval", "2")
    assert "seq_load_balancing_loss: " in log and "global_load_balancing_loss: " in log
    keys = [f"model.decoder.layers.{i}.mlp.router.expert_bias" for i in (0, 1)]
    bias = torch.cat(list(load_tensors(str(save / "iter_0000002"), keys).values()))
    # Two updates of -0.01, 0 or +0.01 per expert; the loads were not balanced everywhere.
    steps = (bias / 0.01).round()
    torch.testing.assert_close(bias, steps * 0.01)
    assert steps.abs().max() <= 2 and steps.abs().max() > 0
    resumed, log = run(tmp_path, "resumed", 2, *ROUTER, "--load", str(save / "iter_0000002"))
    assert "resumed from" in log
    for it in (3, 4):
        assert resumed[it]["lm_loss"] == pytest.approx(full[it]["lm_loss"], rel=2e-5)
        assert resumed[it]["global_load_balancing_loss"] == pytest.approx(
            full[it]["global_load_balancing_loss"], rel=1e-5)


def test_experts_split_apart_from_tp_match_ep1_and_reshard_across_etp(layouts, tmp_path):
    """--expert-tensor-parallel-size 1 under TP=2 (EP=2: the EP groups are the TP pairs;
    each TP rank routes its half of the sequence) trains like EP=1 at 2 ranks; its
    checkpoint of iteration 2 resumes at TP=2 with the experts split like the dense layers
    (ETP=2, EP=1) exactly where it went on."""
    ep1, _, _, _ = layouts
    save = tmp_path / "ckpt"
    etp1, log = run(tmp_path, "tp2-etp1-ep2", 4, "--tensor-model-parallel-size", "2",
                    "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2",
                    "--save", str(save), "--save-interval", "2")
    for it in range(1, ITERS + 1):
        assert etp1[it]["lm_loss"] == pytest.approx(ep1[it]["lm_loss"], rel=2e-5), it
        assert etp1[it]["grad_norm"] == pytest.approx(ep1[it]["grad_norm"], rel=1e-4), it
    for layer in (1, 2):  # counted once per token
        assert etp1[1][f"moe/layer{layer}/max_tokens_per_expert"] == ep1[1][f"moe/layer{layer}/max_tokens_per_expert"]
    resumed, log = run(tmp_path, "resumed-etp2", 4, "--tensor-model-parallel-size", "2",
                       "--load", str(save / "iter_0000002"))
    assert "resumed from" in log
    for it in (3, 4):
        assert resumed[it]["lm_loss"] == pytest.approx(etp1[it]["lm_loss"], rel=2e-5)
        assert resumed[it]["grad_norm"] == pytest.approx(etp1[it]["grad_norm"], rel=1e-4)


MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3", "--moe-aux-loss-coeff", "0.01"]


def test_multi_token_prediction_logged_saved_and_resumed_across_ep(tmp_path):
    """Two MTP depths at EP=2: each depth's loss is in the log line and metrics.jsonl, the
    checkpoint holds the MTP layers (under upstream's names, experts globally), and a run
    resumed from iteration 2 at EP=1 goes on exactly."""
    from megatron.core.distributed.mfsdp_v2.checkpoint import load_tensors

    save = tmp_path / "ckpt"
    full, log = run(tmp_path, "full", 2, *MTP, "--expert-model-parallel-size", "2", "--save", str(save),
                    "--save-interval", "2")
    assert "mtp_1 loss: " in log and "mtp_2 loss: " in log
    for it in range(1, ITERS + 1):
        assert full[it]["mtp_1_loss"] > full[it]["lm_loss"] * 0.5  # a real cross entropy (of a harder task)
    assert full[ITERS]["mtp_2_loss"] != full[1]["mtp_2_loss"]
    key = "model.mtp.layers.1.mtp_model_layer.mlp.experts.linear_fc1.weight"
    experts = load_tensors(str(save / "iter_0000002"), [key])[key]
    assert experts.shape[0] == 4 * 64 * (2 if "--swiglu" in ARGS else 1)  # all 4 experts, stored globally
    resumed, log = run(tmp_path, "resumed", 2, *MTP, "--load", str(save / "iter_0000002"))
    assert "resumed from" in log
    for it in (3, 4):
        assert resumed[it]["lm_loss"] == pytest.approx(full[it]["lm_loss"], rel=2e-5)
        assert resumed[it]["mtp_2_loss"] == pytest.approx(full[it]["mtp_2_loss"], rel=2e-5)
