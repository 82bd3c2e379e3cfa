"""pretrain_gpt.py end to end with tensor parallelism: 4 ranks as TP=2 x DP=2 give the
losses and gradient norms of TP=1 at 2 ranks with the same global batch.

A Llama-style model (GQA, SwiGLU, RMSNorm, RoPE, untied output) in fp32 without dropout:
the initial global weights do not depend on the TP size, the two TP ranks of a
data-parallel rank read the same samples, and the loss is normalized over the global
batch, so the runs differ only by reduction order. MFSDP with sequence parallelism and
DDP without it (DDP over the data-parallel group). The TP=2 run saves at iteration 2;
resumed at TP=1 on 2 ranks, its checkpoint (global tensors) continues the same curve,
and the final checkpoints of both converts to the same Hugging Face model.
"""

import os
import subprocess
import sys

import pytest
import torch

from test_pretrain_gpt import MODEL_ARGS, REPO, SAVE, run_layouts

ITERS = 4
ARGS = list(MODEL_ARGS)
ARGS[ARGS.index("--train-iters") + 1] = str(ITERS)
ARGS[ARGS.index("--eval-interval") + 1] = str(ITERS)
ARGS[ARGS.index("--eval-iters") + 1] = "1"
ARGS += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--num-query-groups", "2",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear"]

RUNS = {
    "tp1-dp2-mfsdp": (2, ["--use-mfsdp"]),
    "tp2-dp2-mfsdp-sp": (4, ["--use-mfsdp", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                             "--save", SAVE + "/tp2", "--save-interval", "2"]),
    "tp2-dp2-ddp": (4, ["--tensor-model-parallel-size", "2"]),
    "tp1-dp2-resumed": (2, ["--use-mfsdp", "--load", SAVE + "/tp2/iter_0000002", "--save", SAVE + "/tp1"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_layouts(ARGS, RUNS, tmp_path_factory)


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


def test_tp2_checkpoint_resumes_at_tp1(runs):
    train, _, _ = runs["tp1-dp2-mfsdp"]
    resumed, _, stdout = runs["tp1-dp2-resumed"]
    assert "resumed from" in stdout and sorted(resumed) == list(range(3, ITERS + 1))
    for it in range(3, ITERS + 1):
        assert resumed[it]["lm_loss"] == pytest.approx(train[it]["lm_loss"], rel=2e-5, abs=1e-6), it


def test_tp2_and_tp1_checkpoints_convert_to_the_same_hugging_face_model(runs, tmp_path):
    from safetensors.torch import load_file

    converted = {}
    for name in ("tp2", "tp1"):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "checkpoint", "convert.py"), "--input",
                               os.path.join(runs["checkpoints"], name), "--to", "hf", "--output", str(out), "--quiet"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:]
        converted[name] = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert converted["tp2"] and sorted(converted["tp2"]) == sorted(converted["tp1"])
    for key, tensor in converted["tp1"].items():
        torch.testing.assert_close(converted["tp2"][key], tensor, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
