"""scripts/replay_upstream_configs.py over the snapshot of upstream's GPT command lines:
the number this trainer accepts must not drop (raise ACCEPTED when a flag starts to parse)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, os.pardir, "scripts"))

import doc_figures  # noqa: E402
import pytest  # noqa: E402
import replay_upstream_configs as replay  # noqa: E402

# Lines that parse with their own parallel sizes (25 at first; 29 after the fidelity flags;
# 102 with pipeline parallelism; 119 with context parallelism; 127 with --expert-tensor-parallel-size;
# 129 with multi-latent attention; 130 with the GPU-only MoE flags accepted and
# upstream's [ ] list values; 133 with the deferred embedding wgrad and the param-gather
# overlap announced; 142 with the re-run state machine's flags and the weight hash check; 146 with
# --test-mode and upstream's leniency on --recompute-num-layers; 151 with the gated delta net; 153
# with --use-torch-fsdp2; 156 with --disable-gloo-process-groups and --use-mup; 158 with --fim-data).
ACCEPTED = 158
# Upstream's MoE recipes (test_cases/moe, --suite moe): 16 of 51 before the GPU-only flags,
# YaRN, --recompute-modules and --logging-level; 17 after; 23 with EP under DDP run as MFSDP
# no_shard; 32 with expert TP apart from TP, multi-latent attention and MoE under CP; 36 with Muon;
# 38 with the weight hash check; 39 with mla_up_proj; 42 with the CPU attention-kernel substitutions
# and --save-interval without --save as a note; 46 with sinkhorn over the CP/SP chunks; 51 with
# multi-token prediction under pipeline parallelism (the layout's 'm' included).
ACCEPTED_MOE = 51


@pytest.fixture(scope="module")
def gpt_replay():
    commit, configs = replay.load_snapshot()
    counts, rejections = replay.replay(configs)
    return commit, counts, rejections


@pytest.fixture(scope="module")
def moe_replay():
    commit, configs = replay.load_snapshot(replay.SUITES["moe"][1])
    counts, rejections = replay.replay(configs)
    return commit, counts, rejections


def test_the_docs_quote_these_counts(gpt_replay, moe_replay, monkeypatch):
    """README.md and docs/megatron_flags.md state the replay's counts (scripts/doc_figures.py
    --write puts them there); the replays above are this test's source."""
    monkeypatch.setattr(doc_figures, "_REPLAY_CACHE", {"gpt": (gpt_replay[0], dict(gpt_replay[1])),
                                                       "moe": (moe_replay[0], dict(moe_replay[1]))})
    assert doc_figures.stale(doc_figures.LIVE) == []


def test_replay_counts_do_not_drop(gpt_replay):
    _, counts, rejections = gpt_replay
    assert counts["skipped (MODE inference/rl)"] == 44 and counts["training lines"] == 161
    assert counts["accepted"] >= ACCEPTED, dict(rejections)
    assert counts["blocked by PP/CP"] == 0, dict(rejections)  # both are in the trainer


def test_moe_replay_counts_do_not_drop(moe_replay):
    _, counts, rejections = moe_replay
    assert counts["skipped (MODE inference/rl)"] == 14 and counts["training lines"] == 51
    assert counts["accepted"] >= ACCEPTED_MOE, dict(rejections)
    assert counts["blocked by PP/CP"] == 0, dict(rejections)


def test_replay_without_tensorboard_counts_the_same_and_names_the_extra(tmp_path):
    """Without TensorBoard every upstream line's --tensorboard-dir fails to parse: the replay
    leaves that flag out, counts as with it installed, and names the extra in one line. The
    package is made unimportable the way test_clean_errors.py does it (a shadowing package)."""
    import json
    import subprocess

    shadow = tmp_path / "tensorboard"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('No module named tensorboard')\n")
    _, configs = replay.load_snapshot()
    subset = dict(sorted((name, config) for name, config in configs.items()
                         if config[0] not in replay.SKIPPED_MODES)[:6])
    assert all(any(flag == "--tensorboard-dir" for flag, _ in pairs) for _, pairs in subset.values())
    (tmp_path / "subset.json").write_text(json.dumps(subset))
    code = ("import json, sys; sys.path.insert(0, 'scripts'); import replay_upstream_configs as r; "
            f"configs = {{k: tuple(v) for k, v in json.load(open({str(tmp_path / 'subset.json')!r})).items()}}; "
            "missing = set(); counts, _ = r.replay(configs, missing=missing); "
            "print(json.dumps(dict(counts))); print(r.missing_note(missing))")
    repo = os.path.abspath(os.path.join(HERE, os.pardir, os.pardir))
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{repo}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts_line, note = proc.stdout.strip().splitlines()[-2:]
    expected, _ = replay.replay({k: tuple(v) for k, v in subset.items()})  # tensorboard installed here
    assert json.loads(counts_line) == dict(expected) and expected["accepted"] > 0
    assert note == ("note: tensorboard not installed: the flags that need it were left out of the lines (the counts "
                    "are those of an install with it); install with `MEGATRON_EXTRAS=logging source "
                    "scripts/setup_env.sh`")
