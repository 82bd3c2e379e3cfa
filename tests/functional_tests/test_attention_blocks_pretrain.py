"""pretrain_gpt.py with --qk-layernorm and --attention-output-gate: TP=2 (MFSDP, 2 ranks)
gives the losses and gradient norms of TP=1 (1 rank) on the same global batch.

A Qwen3-Next-style attention in a tiny Llama-style model, fp32, no dropout, Adam (whose
steps do not shrink with a gradient's size, so a q/k norm gradient that misses the other
rank's heads changes the next losses). The layout-invariant initializer gives both runs
the same global weights; they differ only by reduction order. The sequence-parallel
variant is tested in tests/unit_tests/distributed/tensor_parallel/test_tp_attention_blocks.py.
"""

import pytest

from test_pretrain_gpt import MODEL_ARGS, read_metrics, run_ranks

ITERS = 3
ARGS = list(MODEL_ARGS)
ARGS[ARGS.index("--train-iters") + 1] = str(ITERS)
ARGS[ARGS.index("--eval-interval") + 1] = "100"
# Large first steps: a q/k norm weight moves by about lr whatever its gradient's size.
ARGS[ARGS.index("--lr") + 1] = "3e-2"
ARGS[ARGS.index("--lr-warmup-iters") + 1] = "0"
ARGS += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--num-query-groups", "2",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--qk-layernorm", "--attention-output-gate",
         "--use-mfsdp"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, nproc, flags in (("tp1", 1, []), ("tp2", 2, ["--tensor-model-parallel-size", "2"])):
        log_dir = tmp_path_factory.mktemp(name) / "logs"
        proc = run_ranks(ARGS + flags + ["--log-dir", str(log_dir)], nproc=nproc)
        out[name] = read_metrics(str(log_dir))[0], proc.stdout
    return out


def test_tp2_equals_tp1_with_qk_layernorm_and_output_gate(runs):
    reference, _ = runs["tp1"]
    train, stdout = runs["tp2"]
    assert "tensor parallel 2 x data parallel 1" in stdout
    assert sorted(train) == sorted(reference) == list(range(1, ITERS + 1))
    assert reference[ITERS]["lm_loss"] != reference[1]["lm_loss"]  # it trained
    for it in range(1, ITERS + 1):
        assert train[it]["lm_loss"] == pytest.approx(reference[it]["lm_loss"], rel=2e-5, abs=1e-6), it
        assert train[it]["grad_norm"] == pytest.approx(reference[it]["grad_norm"], rel=1e-4, abs=1e-6), it


# Multi-latent attention (DeepSeek-V3 style, q compression and the latent norms): the down
# projections are replicated, the up projections split by heads, the shared rope key's
# gradient summed over TP (without SP by the model, with SP by the gather's backward).
MLA_ARGS = list(ARGS[:ARGS.index("--qk-layernorm")]) + [
    "--qk-layernorm", "--use-mfsdp", "--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16",
    "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "12"]


@pytest.fixture(scope="module")
def mla_runs(tmp_path_factory):
    out = {}
    for name, nproc, flags in (("tp1", 1, []), ("tp2", 2, ["--tensor-model-parallel-size", "2"]),
                               ("tp2-sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])):
        log_dir = tmp_path_factory.mktemp("mla-" + name) / "logs"
        proc = run_ranks(MLA_ARGS + flags + ["--log-dir", str(log_dir)], nproc=nproc)
        out[name] = read_metrics(str(log_dir))[0], proc.stdout
    return out


@pytest.mark.parametrize("name", ["tp2", "tp2-sp"])
def test_tp2_equals_tp1_with_multi_latent_attention(mla_runs, name):
    reference, _ = mla_runs["tp1"]
    train, _ = mla_runs[name]
    assert sorted(train) == sorted(reference) == list(range(1, ITERS + 1))
    assert reference[ITERS]["lm_loss"] != reference[1]["lm_loss"]
    for it in range(1, ITERS + 1):
        assert train[it]["lm_loss"] == pytest.approx(reference[it]["lm_loss"], rel=2e-5, abs=1e-6), it
        assert train[it]["grad_norm"] == pytest.approx(reference[it]["grad_norm"], rel=1e-4, abs=1e-6), it


# Qwen3-Next's hybrid: a gated delta net on layer 1, gated softmax attention on layer 2
# (--linear-attention-freq 2), its norm output recomputed (gdn_norm_out). Under TP the
# in_proj blocks, the convolution's channels, A_log and dt_bias are split by heads; the
# gated norm's weight is replicated (its gradient summed over TP by the model without SP,
# by the trainer with SP).
GDN_ARGS = list(ARGS) + [
    "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2",
    "--linear-conv-kernel-dim", "4", "--linear-key-head-dim", "8", "--linear-value-head-dim", "8",
    "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
    "--recompute-granularity", "selective", "--recompute-modules", "core_attn", "gdn_norm_out"]


@pytest.fixture(scope="module")
def gdn_runs(tmp_path_factory):
    out = {}
    # TP=2 without SP: tests/unit_tests/distributed/tensor_parallel/test_tp_gated_delta_net.py.
    for name, nproc, flags in (("tp1", 1, []),
                               ("tp2-sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])):
        log_dir = tmp_path_factory.mktemp("gdn-" + name) / "logs"
        proc = run_ranks(GDN_ARGS + flags + ["--log-dir", str(log_dir)], nproc=nproc)
        out[name] = read_metrics(str(log_dir))[0], proc.stdout
    return out


def test_tp2_sp_equals_tp1_with_gated_delta_net(gdn_runs):
    reference, _ = gdn_runs["tp1"]
    train, stdout = gdn_runs["tp2-sp"]
    assert "tensor parallel 2 x data parallel 1" in stdout
    print("gdn lm_loss |tp2-sp - tp1|:", [abs(train[i]["lm_loss"] - reference[i]["lm_loss"]) for i in reference])
    assert sorted(train) == sorted(reference) == list(range(1, ITERS + 1))
    assert reference[ITERS]["lm_loss"] != reference[1]["lm_loss"]
    for it in range(1, ITERS + 1):
        assert train[it]["lm_loss"] == pytest.approx(reference[it]["lm_loss"], rel=1e-5, abs=1e-6), it
        assert train[it]["grad_norm"] == pytest.approx(reference[it]["grad_norm"], rel=1e-4, abs=1e-6), it
