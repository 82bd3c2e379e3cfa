"""setup.py: the base install is what training needs; the test extras cover every test import.

scripts/setup_env.sh installs the base for the Quickstart's training command and
scripts/run_tests.sh asks for ``[test]``; a package a test imports but no extra lists
would break the suite on a fresh machine.
"""

import ast
import glob
import os
import runpy
import sys
import types

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
# Import name -> distribution name, where they differ or are not obvious.
DISTRIBUTIONS = {"torch": "torch", "numpy": "numpy", "regex": "regex", "tqdm": "tqdm", "tokenizers": "tokenizers",
                 "transformers": "transformers", "safetensors": "safetensors", "tensorboard": "tensorboard",
                 "wandb": "wandb", "psutil": "psutil", "pytest": "pytest", "matplotlib": "matplotlib",
                 "sentencepiece": "sentencepiece", "torchft": "torchft", "tiktoken": "tiktoken"}
# The repository's own packages, and the scripts/ modules tests import by name.
LOCAL = {"megatron", "tools", "pretrain_gpt", "benchmarks"} | {
    os.path.splitext(os.path.basename(p))[0] for folder in ("scripts", "benchmarks")
    for p in glob.glob(os.path.join(REPO, folder, "*.py"))}


def _setup_kwargs(monkeypatch):
    captured = {}
    fake = types.ModuleType("setuptools")  # setup.py's setup() records its arguments, installs nothing
    fake.setup = lambda **kw: captured.update(kw)
    fake.find_packages = lambda **kw: []
    monkeypatch.setitem(sys.modules, "setuptools", fake)
    monkeypatch.chdir(REPO)
    runpy.run_path(os.path.join(REPO, "setup.py"))
    return captured


def _names(requirements):
    return {r.split("==")[0].split("[")[0] for r in requirements}


def _imported_modules(pattern):
    modules = set()
    for path in glob.glob(os.path.join(REPO, pattern), recursive=True):
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                modules.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return modules


def test_base_install_is_what_training_needs(monkeypatch):
    kw = _setup_kwargs(monkeypatch)
    base = _names(kw["install_requires"])
    assert {"torch", "tokenizers"} <= base
    assert not base & {"transformers", "matplotlib", "tensorboard", "wandb", "safetensors", "pytest"}


def test_test_extras_cover_every_test_import(monkeypatch):
    kw = _setup_kwargs(monkeypatch)
    available = _names(kw["install_requires"]) | _names(kw["extras_require"]["test"])
    # Test modules import helpers and other test modules by bare name.
    test_modules = {os.path.splitext(os.path.basename(p))[0]
                    for p in glob.glob(os.path.join(REPO, "tests/**/*.py"), recursive=True)}
    third_party = {m for m in _imported_modules("tests/**/*.py")
                   if m not in sys.stdlib_module_names and m not in LOCAL | test_modules and not m.startswith("_")}
    unknown = third_party - set(DISTRIBUTIONS)
    assert not unknown, f"map these test imports to their distributions in DISTRIBUTIONS: {unknown}"
    missing = {DISTRIBUTIONS[m] for m in third_party} - available
    assert not missing, f"tests import {missing}, which neither the base install nor [test] provides"
