"""scripts/run_doc_commands.py: every command block of the docs is marked, the markers parse,
the assertions catch what they promise to catch, and MEGATRON_MAX_TRAIN_ITERS (the one switch
that shortens documented runs) caps a run without touching its schedule. The documented
commands themselves run in the doc-test stage of scripts/run_tests.sh."""

import argparse
import os
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import run_doc_commands as rdc  # noqa: E402

from megatron.training.arguments import apply_max_train_iters  # noqa: E402


def test_every_command_block_of_the_docs_is_marked():
    blocks = rdc.all_blocks()
    paths = {b.path for b in blocks}
    assert {"README.md", "examples/README.md", "docs/checkpointing.md"} <= paths
    for b in blocks:
        assert b.skip or set(b.marker) - {"timeout"}, f"{b.where} runs but asserts nothing beyond exit 0"
    run = [b for b in blocks if not b.skip]
    assert any("train_tiny_shakespeare" in b.command for b in run)
    assert any("pretrain_gpt.py" in b.command and "loss-falls" in b.marker for b in run)


def _doc(tmp_path, text):
    (tmp_path / "doc.md").write_text(text)
    return rdc.extract_blocks("doc.md", repo=str(tmp_path))


def test_an_unmarked_block_and_a_bad_marker_are_errors(tmp_path):
    with pytest.raises(ValueError, match="without a doctest marker"):
        _doc(tmp_path, "Run:\n\n```bash\necho hi\n```\n")
    with pytest.raises(ValueError, match="unknown doctest key 'fiel'"):
        _doc(tmp_path, "<!-- doctest: fiel=x -->\n```bash\necho hi\n```\n")
    with pytest.raises(ValueError, match="skip needs a reason"):
        _doc(tmp_path, "<!-- doctest: skip= -->\n```bash\necho hi\n```\n")
    # Other fences are not commands; a marker may be separated from its block by blank lines.
    blocks = _doc(tmp_path, "```text\nbash x\n```\n<!-- doctest: output=\"a b\" exit=3 -->\n\n```bash\nexit 3\n```\n")
    assert [(b.line, b.marker) for b in blocks] == [(6, {"output": ["a b"], "exit": ["3"]})]


@pytest.mark.parametrize("command, marker, broken", [
    ("echo '| lm loss: 8.0 |'; echo '| lm loss: 7.0 |'", {"loss-falls": [""], "loss-below": ["7.5"]}, None),
    ("echo '| lm loss: 7.0 |'; echo '| lm loss: 8.0 |'", {"loss-falls": [""]}, "does not fall"),
    ("echo '| lm loss: 7.0 |'", {"loss-falls": [""]}, "does not fall"),
    ("echo 'lm loss value: 8.1 |'", {"loss-below": ["8.0"]}, "not below 8.0"),
    ("false; echo never", {}, "exit status 1, expected 0"),
    ("exit 2", {"exit": ["2"]}, None),
    ("echo hello", {"output": ["hel+o"], "file": ["out.txt"]}, "out.txt does not exist"),
    ("echo hello > out.txt", {"output": ["goodbye"], "file": ["out.txt"]}, "no match for 'goodbye'"),
    ("sleep 30", {"timeout": ["1"]}, "still running after 1 s"),
    ("echo 'est 10.4'; echo 'got 10.0'", {"agree": ["5% ; est ([0-9.]+) ; got ([0-9.]+)"]}, None),
    ("echo 'est 10.6'; echo 'got 10.0'", {"agree": ["5% ; est ([0-9.]+) ; got ([0-9.]+)"]}, "not within 5%"),
    ("echo 'est 10.4'", {"agree": ["5% ; est ([0-9.]+) ; got ([0-9.]+)"]}, "no match for 'got ([0-9.]+)'"),
])
def test_each_assertion_fails_when_its_promise_is_broken(tmp_path, command, marker, broken):
    env = dict(os.environ, VIRTUAL_ENV=os.path.dirname(os.path.dirname(sys.executable)))
    failures = rdc.run_block(rdc.Block("doc.md", 1, command + "\n", marker), str(tmp_path), env,
                             str(tmp_path / "log"))
    if broken is None:
        assert failures == []
    else:
        assert len(failures) == 1 and broken in failures[0], failures


def test_max_train_iters_caps_the_run_but_not_its_schedule(capsys):
    args = argparse.Namespace(train_iters=600, lr_decay_iters=600)
    apply_max_train_iters(args, {})
    assert args.train_iters == 600
    apply_max_train_iters(args, {"MEGATRON_MAX_TRAIN_ITERS": "20"})
    assert (args.train_iters, args.lr_decay_iters) == (20, 600)
    assert "MEGATRON_MAX_TRAIN_ITERS=20: training stops after iteration 20 of --train-iters 600" in capsys.readouterr().out
    apply_max_train_iters(args, {"MEGATRON_MAX_TRAIN_ITERS": "50"})  # above the run's length: nothing to say
    assert args.train_iters == 20 and capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="must be a positive integer"):
        apply_max_train_iters(args, {"MEGATRON_MAX_TRAIN_ITERS": "ten"})


def test_a_block_repeated_with_other_comments_is_the_same_command():
    a = rdc.Block("a.md", 1, "bash examples/x.sh   # train it\n")
    b = rdc.Block("b.md", 9, "# the example\nbash examples/x.sh\n")
    assert a.commands_only() == b.commands_only() == "bash examples/x.sh"
    assert rdc.Block("c.md", 1, "echo '# not a comment'\n").commands_only() == "echo '# not a comment'"
    # Activating the environment changes nothing in the runner's shell: README's and docs/'s
    # run of the same example is one run.
    assert rdc.Block("d.md", 1, "source scripts/setup_env.sh\nbash examples/x.sh\n").commands_only() == \
        "bash examples/x.sh"
