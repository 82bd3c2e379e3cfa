"""pretrain_gpt.py --fim-data: a tiny model trains on fill-in-the-middle samples made with a
real tokenizer file holding upstream's FIM tokens (a tokenizer without them:
tests/unit_tests/training/test_fim_arguments.py)."""

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "unit_tests", "datasets"))

from test_clean_errors import run  # noqa: E402
from test_fim import TEXT, build_char_tokenizer  # noqa: E402
from test_pretrain_gpt import read_metrics  # noqa: E402

ARGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--global-batch-size 4 --lr 1e-3 --train-iters 3 --eval-iters 0 --num-workers 0 --log-interval 1 "
        "--hidden-dropout 0 --attention-dropout 0 --split 100,0,0 --fim-data --fim-rate 0.9").split()


def _data(tmp_path, tokenizer_dir):
    from megatron.core.datasets import IndexedDatasetBuilder
    from megatron.core.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(tokenizer_dir)
    prefix = str(tmp_path / "code")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for text in TEXT * 8:
        builder.add_item(np.array(tok.tokenize(text) + [tok.eod]))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_fim_data_trains(tmp_path):
    tokenizer_dir = build_char_tokenizer(tmp_path / "tok")
    proc = run(ARGS + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir,
                       "--data-path", _data(tmp_path, tokenizer_dir), "--data-cache-path", str(tmp_path / "cache"),
                       "--log-dir", str(tmp_path / "logs")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train, _ = read_metrics(str(tmp_path / "logs"))
    assert sorted(train) == [1, 2, 3]
    assert all(np.isfinite(r["lm_loss"]) for r in train.values())

