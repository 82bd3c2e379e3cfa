"""scripts/replay_upstream_configs.py over the snapshot of upstream's GPT command lines:
the number this trainer accepts must not drop (raise ACCEPTED when a flag starts to parse)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, os.pardir, "scripts"))

import replay_upstream_configs as replay  # noqa: E402

ACCEPTED = 29  # lines that parse with their own parallel sizes (25 before --sequence-parallel at TP 1, --decoupled-lr, ...)
ACCEPTED_AT_PP_CP_ONE = 29 + 90  # ... plus those that parse once PP/CP are 1 (25 + 74 before)


def test_replay_counts_do_not_drop(capsys):
    _, configs = replay.load_snapshot()
    counts, rejections = replay.replay(configs)
    assert counts["skipped (MODE inference/rl)"] == 44 and counts["training lines"] == 161
    assert counts["accepted"] >= ACCEPTED, dict(rejections)
    assert counts["accepted"] + counts["blocked by PP/CP"] >= ACCEPTED_AT_PP_CP_ONE, dict(rejections)
