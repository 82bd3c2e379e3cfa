"""Every tools/generate.py command the examples run or show samples (top-k above 1, a
temperature, a seed): greedy decoding on a tiny model prints one token over and over."""

import glob
import os
import shlex

from tools import generate

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))


def generate_commands():
    commands = []
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "examples", "*.sh"))) + [
            os.path.join(REPO_ROOT, "examples", "README.md")]:
        text = open(path, encoding="utf-8").read().replace("\\\n", " ")
        for line in text.splitlines():
            if line.lstrip().startswith("python tools/generate.py"):
                commands.append((os.path.basename(path), shlex.split(line.split("python tools/generate.py", 1)[1])))
    return commands


def test_example_generation_samples():
    commands = generate_commands()
    assert {name for name, _ in commands} >= {"README.md", "train_tiny_shakespeare.sh"}
    for name, argv in commands:
        opts = generate.get_parser().parse_args(argv)  # the flags exist and parse
        assert opts.top_k is not None and opts.top_k > 1, (name, argv)
        assert "--temperature" in argv and "--seed" in argv, (name, argv)
