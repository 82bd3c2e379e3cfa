"""What the documented commands write is git-ignored, so following the docs leaves
`git status` clean: every output path (--save, --output, --out-dir, ...) named in a
command block of README.md, docs/*.md or examples/README.md, and the trainer's outputs."""

import glob
import os
import re
import subprocess

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))

DOCS = ["README.md", "examples/README.md", *sorted(os.path.relpath(p, REPO_ROOT)
                                                   for p in glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))]
OUTPUT_FLAGS = re.compile(r"(?:--save|--output|--output-prefix|--out-dir|--tensorboard-dir|--log-dir|"
                          r"--wandb-save-dir)[ =]+([A-Za-z0-9_./-]+)")
# Written by commands the docs describe in prose (the default corpus, example runs, the
# preprocessing tool's documented prefix, the trainer's default W&B directory).
ALWAYS = ["runs/tiny_shakespeare/checkpoints/iter_0000001/common.json", "data/cache/shakespeare_gpt2_text_document.bin",
          "data/corpus_text_document.idx", "wandb/run-1/files/config.yaml", "checkpoints/shakespeare/x"]


def documented_outputs():
    paths = []
    for doc in DOCS:
        text = open(os.path.join(REPO_ROOT, doc), encoding="utf-8").read()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            for path in OUTPUT_FLAGS.findall(block):
                if path.isupper() or path.startswith(("/", "$")):  # placeholders, absolute paths
                    continue
                paths.append(path.rstrip("/") + "/x")  # a file the command writes there
    return sorted(set(paths))


def test_documented_outputs_are_ignored():
    paths = documented_outputs()
    assert {"ckpt/run1/x", "exported/x", "ckpt/imported/x"} <= set(paths), paths  # the scan finds the docs' paths
    run = subprocess.run(["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *paths, *ALWAYS],
                         cwd=REPO_ROOT, capture_output=True, text=True)
    not_ignored = [line.split("\t", 1)[1] for line in run.stdout.splitlines() if line.startswith("::")]
    assert not not_ignored, f"add these documented outputs to .gitignore: {not_ignored}"
