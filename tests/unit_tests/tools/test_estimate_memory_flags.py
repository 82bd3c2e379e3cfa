"""tools/estimate_memory.py plans from the model's flags alone: --lr and --train-iters are
training-only and may be left out (the plan is the same with them)."""

import pytest

from tools.estimate_memory import main

MODEL = ["--world-size", "2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96"]


def test_plans_without_training_only_flags(capsys):
    bare = main(MODEL)
    bare_out = capsys.readouterr().out
    full = main(MODEL + ["--lr", "3e-4", "--train-iters", "5"])
    assert capsys.readouterr().out == bare_out
    assert [p.strategy for p in bare] == [p.strategy for p in full] == ["ddp", "zero1", "zero2", "zero3", "hsdp",
                                                                         "hfsdp"]
    # A run given in samples keeps its own length (the trainer refuses two lengths at once).
    main(MODEL + ["--train-samples", "100", "--lr-warmup-samples", "10"])
    # The trainer's checks still apply to the model's flags.
    with pytest.raises(SystemExit, match="--num-attention-heads"):
        main(MODEL + ["--hidden-size", "30"])
