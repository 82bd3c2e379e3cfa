"""pretrain_gpt.py end to end with tensor parallelism: 4 ranks as TP=2 x DP=2 give the
losses and gradient norms of TP=1 at 2 ranks with the same global batch.

A Llama-style model (GQA, SwiGLU, RMSNorm, RoPE, untied output) in fp32 without dropout:
the initial global weights do not depend on the TP size, the two TP ranks of a
data-parallel rank read the same samples, and the loss is normalized over the global
batch, so the runs differ only by reduction order. MFSDP with sequence parallelism and
DDP without it (DDP over the data-parallel group).
"""

import pytest

from test_pretrain_gpt import MODEL_ARGS, read_metrics, run_torchrun

ITERS = 4
ARGS = list(MODEL_ARGS)
ARGS[ARGS.index("--train-iters") + 1] = str(ITERS)
ARGS[ARGS.index("--eval-interval") + 1] = str(ITERS)
ARGS[ARGS.index("--eval-iters") + 1] = "1"
ARGS += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--num-query-groups", "2",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear"]

RUNS = {
    "tp1-dp2-mfsdp": (2, ["--use-mfsdp"]),
    "tp2-dp2-mfsdp-sp": (4, ["--use-mfsdp", "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2-dp2-ddp": (4, ["--tensor-model-parallel-size", "2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, (nproc, flags) in RUNS.items():
        log_dir = tmp_path_factory.mktemp(name) / "logs"
        proc = run_torchrun(ARGS + flags + ["--log-dir", str(log_dir)], nproc=nproc)
        out[name] = read_metrics(str(log_dir)) + (proc.stdout,)
    return out


def test_tensor_parallel_losses_equal_tp1(runs):
    train, valid, _ = runs["tp1-dp2-mfsdp"]
    assert train[ITERS]["lm_loss"] != train[1]["lm_loss"]  # the model trained
    for name in ("tp2-dp2-mfsdp-sp", "tp2-dp2-ddp"):
        tp_train, tp_valid, stdout = runs[name]
        assert sorted(tp_train) == list(range(1, ITERS + 1)), name
        for it in range(1, ITERS + 1):
            assert tp_train[it]["lm_loss"] == pytest.approx(train[it]["lm_loss"], rel=2e-5, abs=1e-6), (name, it)
            assert tp_train[it]["grad_norm"] == pytest.approx(train[it]["grad_norm"], rel=1e-4, abs=1e-6), (name, it)
            assert tp_train[it]["consumed_samples"] == 8 * it
        assert tp_valid[ITERS]["lm_loss"] == pytest.approx(valid[ITERS]["lm_loss"], rel=2e-5), name
        assert "tensor parallel 2 x data parallel 2" in stdout, name
