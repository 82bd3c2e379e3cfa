"""Upstream Megatron-LM's functional-test lines trained at their own layouts.

scripts/replay_upstream_configs.py's TRAINED_SAMPLE (lines of upstream's
tests/functional_tests/test_cases/{gpt,moe}, read from the snapshots in
this directory, so no mirror is needed) each runs pretrain_gpt.py for 3 iterations
with the replay's CPU substitutions and tiny model, at the line's own TP/PP/CP/EP sizes on
the fewest CPU ranks that hold them (the data-parallel size shrinks). Each must exit 0,
print 3 iteration lines with finite losses, and report its layout in the "> model:" line.

Each line's ranks are forked from one process that imported the trainer once
(tests/functional_tests/forked_launch.py): about 2-15 s a line on 2 cores.
scripts/run_tests.sh runs this directory as a stage of its own (upstream's command lines),
not with tests/functional_tests.
"""

import math
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, os.pardir, "scripts"))
sys.path.insert(0, os.path.join(HERE, os.pardir, "functional_tests"))

import forked_launch  # noqa: E402
import replay_upstream_configs as replay  # noqa: E402


def forked(argv, world, env, timeout):
    """The ranks forked from one process that imported the trainer once (forked_launch.py):
    the script's own torchrun launch costs a launcher and N interpreters' imports per line."""
    proc = forked_launch.server().launch("pretrain_gpt.py", argv, nproc=world, env=env, timeout=timeout)
    return proc.returncode, proc.stdout


def _features(suite, name):
    pairs = replay.load_line(suite, name)
    tp, pp, cp, ep, etp = replay.layout(pairs)
    flags = {flag: value for flag, value in pairs}
    found = set()
    if pp > 1:
        found.add("PP+VPP" if replay.virtual_stages(pairs) > 1 else "PP")
    if "--decoder-first-pipeline-num-layers" in flags:
        found.add("uneven PP")
    if cp > 1:
        found.add("CP")
    if tp > 1 and flags.get("--sequence-parallel"):
        found.add("TP+SP")
    if tp > 1 and pp > 1:
        found.add("TP x PP")
    if ep > 1:
        found.add("EP+TP" if tp > 1 else "EP")
    if ep > 1 and etp != tp:
        found.add("ETP != TP")
    if flags.get("--multi-latent-attention"):
        found.add("MLA")
    if "--num-experts" in flags:
        found.add("router " + str(flags.get("--moe-router-load-balancing-type", "aux_loss")))
    if flags.get("--experimental-attention-variant") == "gated_delta_net":
        found.add("gated delta net")
    return found


def test_sample_covers_the_layouts_and_blocks():
    """What the sample must keep covering, and within 8 ranks (no training: cheap)."""
    assert len(replay.TRAINED_SAMPLE) >= 20 and len(set(replay.TRAINED_SAMPLE)) == len(replay.TRAINED_SAMPLE)
    covered = set()
    for suite, name in replay.TRAINED_SAMPLE:
        covered |= _features(suite, name)
        assert replay.train_world(*replay.layout(replay.load_line(suite, name))) <= 8, name
    wanted = {"PP", "PP+VPP", "uneven PP", "CP", "TP+SP", "TP x PP", "EP", "EP+TP", "ETP != TP", "MLA",
              "router sinkhorn", "router aux_loss", "router seq_aux_loss", "router global_aux_loss",
              "gated delta net"}
    assert wanted <= covered, wanted - covered


@pytest.mark.parametrize("suite,name", replay.TRAINED_SAMPLE, ids=[name for _, name in replay.TRAINED_SAMPLE])
def test_line_trains_at_its_own_layout(suite, name):
    row = replay.train(suite, name, timeout=300, launch=forked)
    tail = row["output"][-4000:]
    assert row["returncode"] == 0, tail
    assert row["iterations"] == [(1, 3), (2, 3), (3, 3)], tail
    assert all(math.isfinite(loss) for loss in row["losses"]), row["losses"]
    tp, pp, cp, _, _ = row["layout"]
    assert row["world"] % (tp * pp * cp) == 0 and row["world"] <= 8
    missing = [phrase for phrase in row["expected"] if phrase not in row["model"]]
    assert not missing, (missing, row["model"])
