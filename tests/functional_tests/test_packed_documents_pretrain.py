"""pretrain_gpt.py with packed documents (--reset-position-ids --reset-attention-mask
--eod-mask-loss) on real tokenized text: CP=2 (p2p) gives the single-rank losses.

The corpus: short documents of sonnet lines (one to three lines, so every
32-token sample holds several EOD tokens), tokenized by a byte-level BPE trained on them
with tools/preprocess_data.py --append-eod. CP splits each sample's document starts with
its tokens. TP, SP, PP and every CP type are checked against the single-process packed
model in tests/unit_tests/distributed/context_parallel/test_packed_documents.py.
"""

import json

import numpy as np
import pytest

from test_pretrain_gpt import MODEL_ARGS, assert_same_curve, run_layouts

ITERS = 3
LINES = ["From fairest creatures we desire increase,", "That thereby beauty's rose might never die,",
         "But as the riper should by time decease,", "His tender heir might bear his memory:",
         "But thou contracted to thine own bright eyes,", "Feed'st thy light's flame with self-substantial fuel,",
         "Making a famine where abundance lies,", "Thy self thy foe, to thy sweet self too cruel:"]
PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--use-mfsdp"]
RUNS = {
    "ref": (1, PACKED),
    "cp2-p2p": (2, PACKED + ["--context-parallel-size", "2"]),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tools.prepare_shakespeare import train_bpe_tokenizer
    from tools.preprocess_data import main as preprocess_main

    tmp = tmp_path_factory.mktemp("packed")
    tokenizer = train_bpe_tokenizer(["\n".join(LINES)] * 4, 512, str(tmp / "bpe"))
    rng = np.random.RandomState(0)
    with open(tmp / "docs.jsonl", "w") as f:
        for _ in range(200):
            lines = rng.choice(len(LINES), size=rng.randint(1, 4))
            f.write(json.dumps({"text": "\n".join(LINES[i] for i in lines)}) + "\n")
    assert preprocess_main(["--input", str(tmp / "docs.jsonl"), "--output-prefix", str(tmp / "docs"),
                            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer,
                            "--append-eod"]) == 0
    prefix = str(tmp / "docs_text_document")
    lengths = IndexedDataset(prefix).sequence_lengths
    assert 4 <= min(lengths) and max(lengths) < 32 + 10  # several documents per 32-token sample
    return prefix, tokenizer


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    prefix, tokenizer = corpus
    base = list(MODEL_ARGS)
    for flag, value in (("--train-iters", str(ITERS)), ("--eval-interval", str(ITERS)), ("--eval-iters", "1"),
                        ("--hidden-size", "32")):
        base[base.index(flag) + 1] = value
    for flag in ("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"):
        base.remove(flag)
    base += ["--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer,
             "--split", "98,2,0", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
             "--data-cache-path", str(tmp_path_factory.mktemp("index"))]
    return run_layouts(base, RUNS, tmp_path_factory)


def test_packed_documents_under_context_parallel_give_the_single_rank_losses(runs):
    ref_train = runs["ref"][0]
    assert ref_train[ITERS]["lm_loss"] != ref_train[1]["lm_loss"]  # the model trained
    assert_same_curve(runs, "cp2-p2p", "ref", ITERS)
