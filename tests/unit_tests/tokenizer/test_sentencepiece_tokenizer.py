"""--tokenizer-type GPTSentencePieceTokenizer with a SentencePiece .model file."""

import pytest

from megatron.core.tokenizer import build_tokenizer
from megatron.training.arguments import parse_args

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
        "--lr 1e-3 --train-iters 2 --mock-data --tokenizer-type GPTSentencePieceTokenizer").split()


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    import sentencepiece

    root = tmp_path_factory.mktemp("spm")
    corpus = root / "corpus.txt"
    lines = [f"the quick brown fox {i} jumps over the lazy dog number {i * 7}" for i in range(300)]
    corpus.write_text("\n".join(lines))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(root / "m"), vocab_size=60,
                                             model_type="bpe", minloglevel=2)
    return str(root / "m.model")


def test_round_trip_and_eod(model_file):
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model_file)
    ids = tok.tokenize("the lazy dog jumps")
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.detokenize(ids) == "the lazy dog jumps"
    assert tok.vocab_size == 60 and tok.inv_vocab[tok.eod] == "</s>"


def test_parse_time_checks(model_file, tmp_path):
    args = parse_args(BASE + ["--tokenizer-model", model_file], world_size=1, cuda_available=False)
    assert args.tokenizer_model == model_file
    with pytest.raises(ValueError, match="needs --tokenizer-model FILE"):
        parse_args(BASE + ["--tokenizer-model", str(tmp_path / "none.model")], world_size=1, cuda_available=False)
