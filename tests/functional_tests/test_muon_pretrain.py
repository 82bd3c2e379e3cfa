"""pretrain_gpt.py with upstream's Muon flags (its MoE recipes' ``--optimizer muon
--muon-momentum 0.9 --muon-extra-scale-factor 0.2 --muon-scale-mode spectral`` and the
deprecated ``dist_muon``) on 2 ranks: a MoE model with expert parallelism under ZeRO-1
(``--use-distributed-optimizer``) trains like the same model in one process (fp32
Newton-Schulz; no aux loss, whose value depends on how a batch is cut into micro-batches),
and 3 + 3 iterations through a checkpoint give the losses of 6 uninterrupted ones bit for
bit, so Muon's momentum is saved and restored; resumed in one process (EP 1) it gives the
same curve up to reduction order.
"""

import json
import os

import pytest
from test_pretrain_gpt import launch_ranks

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 --seq-length 16 "
         "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 --lr 1e-2 --lr-decay-iters 6 "
         "--mock-data --tokenizer-type NullTokenizer --vocab-size 100 --log-interval 1 --eval-iters 0 "
         "--num-workers 0 --hidden-dropout 0 --attention-dropout 0 --disable-bias-linear --swiglu --num-experts 4 --moe-grouped-gemm "
         "--expert-model-parallel-size 2 --moe-router-load-balancing-type none --muon-fp32-matmul-prec high "
         "--muon-momentum 0.9 --muon-extra-scale-factor 0.2 --muon-scale-mode spectral").split()
TIMEOUT = 600


def _train(tmp, name, *args, nproc=2):
    result = launch_ranks([*MODEL, "--log-dir", str(tmp / name), *args], nproc=None if nproc == 1 else nproc, cwd=tmp,
                          timeout=TIMEOUT)
    assert result.returncode == 0, f"{name}: exit status {result.returncode}\n{result.stdout[-4000:]}"
    losses = {}
    with open(tmp / name / "metrics.jsonl") as f:
        for line in f:
            record = json.loads(line)
            if "lm_loss" in record and record.get("kind", "train") == "train" and "iteration" in record:
                losses[record["iteration"]] = record["lm_loss"]
    return result.stdout, losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon")
    ckpt = tmp / "ckpt"
    whole = _train(tmp, "whole", "--optimizer", "muon", "--use-distributed-optimizer", "--train-iters", "6")
    first = _train(tmp, "first", "--optimizer", "dist_muon", "--train-iters", "3", "--save", str(ckpt),
                   "--save-interval", "3")
    second = _train(tmp, "second", "--optimizer", "muon", "--use-distributed-optimizer", "--train-iters", "6",
                    "--load", str(ckpt))
    one = _train(tmp, "one", "--optimizer", "muon", "--use-mfsdp", "--expert-model-parallel-size", "1",
                 "--train-iters", "6", nproc=1)
    # The 2-rank ZeRO-1 checkpoint (EP 2) resumed in one process: the momentum is stored whole.
    one_resumed = _train(tmp, "one_resumed", "--optimizer", "muon", "--use-mfsdp", "--expert-model-parallel-size",
                         "1", "--train-iters", "6", "--load", str(ckpt), nproc=1)
    return tmp, ckpt, whole, first, second, one, one_resumed


def test_muon_trains(runs):
    _, _, (_, whole), (log, first), _, (_, one), _ = runs
    assert sorted(whole) == [1, 2, 3, 4, 5, 6] and sorted(first) == [1, 2, 3]
    assert all(0 < loss < 10 for loss in whole.values())
    assert "dist_muon is deprecated" in log
    # dist_muon is muon with the distributed optimizer: the same run.
    assert [first[i] for i in (1, 2, 3)] == [whole[i] for i in (1, 2, 3)]
    # Gathering each matrix from its shards gives one process's Muon (up to reduction order).
    assert [whole[i] for i in range(1, 7)] == pytest.approx([one[i] for i in range(1, 7)], rel=2e-5, abs=1e-6)
    assert whole[3] != whole[1]


def test_resume_restores_the_momentum(runs):
    _, ckpt, (_, whole), _, (_, second), _, (_, one_resumed) = runs
    assert sorted(second) == [4, 5, 6]
    assert [second[i] for i in (4, 5, 6)] == [whole[i] for i in (4, 5, 6)]
    metadata = "".join(open(os.path.join(root, f), "rb").read().decode("latin-1")
                       for root, _, files in os.walk(ckpt) for f in files if f.endswith(".metadata"))
    assert "linear_qkv.weight.momentum_buffer" in metadata and "word_embeddings.weight.exp_avg" in metadata
    # At another world size and expert-parallel size: the same curve up to reduction order.
    assert [one_resumed[i] for i in (4, 5, 6)] == pytest.approx([whole[i] for i in (4, 5, 6)], rel=2e-5, abs=1e-6)
