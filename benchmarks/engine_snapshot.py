"""The MFSDP v2 engine as it was at a git revision, importable next to the working tree's.

An engine change is measured before/after in *one* interleaved run: the benchmark builds
contender ``mfsdp_zero3@<rev>`` with the engine files of ``<rev>`` (extracted with
``git show`` into a temporary package ``mfsdp_v2_at_<rev>``) and ``mfsdp_zero3`` with the
working tree's. The engine package imports nothing from the rest of the repository, so
the two copies do not interfere: each has its own classes, hooks and contexts.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from types import ModuleType

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_DIR = "megatron/core/distributed/mfsdp_v2"


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", REPO, *args], check=True, capture_output=True).stdout


def resolve(rev: str) -> str:
    try:
        return _git("rev-parse", "--short", f"{rev}^{{commit}}").decode().strip()
    except subprocess.CalledProcessError as error:
        raise ValueError(f"unknown git revision {rev!r} for an engine snapshot: {error.stderr.decode().strip()}") from None


def load(rev: str) -> ModuleType:
    """Import the engine package at ``rev`` (once per process) and return it."""
    short = resolve(rev)
    name = f"mfsdp_v2_at_{short}"
    if name in sys.modules:
        return sys.modules[name]
    package_dir = os.path.join(tempfile.mkdtemp(prefix=f"mfsdp_engine_{short}_"), name)
    os.makedirs(package_dir)
    # Every .py file of the package, subpackages included (e.g. checkpoint/): -r lists the
    # files of the whole tree below the engine directory, with paths relative to it.
    for path in _git("ls-tree", "-r", "--name-only", f"{short}:{ENGINE_DIR}").decode().splitlines():
        if path.endswith(".py"):
            target = os.path.join(package_dir, path)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                f.write(_git("show", f"{short}:{ENGINE_DIR}/{path}"))
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(package_dir, "__init__.py"), submodule_search_locations=[package_dir]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _keep_row_shards_apart(sys.modules.get(f"{name}.row_shard"))
    return module


def _keep_row_shards_apart(row_shard: ModuleType) -> None:
    """An engine from before ``RowShard.is_even`` defines ``RowShard == `` any dim-0 shard.
    Torch keys its process-wide DTensor caches on placement equality, so such a snapshot
    would find the working tree's cached answers (other row counts, other classes) and the
    tree's its. Its placements keep their own semantics but never equal another copy's.
    A later engine has exact equality already (one of them, from before
    ``row_sharded_tensor.py``, wraps torch's propagator itself: that is the snapshot's own
    code, run only in this benchmark process)."""
    if row_shard is None or hasattr(row_shard.RowShard, "is_even"):
        return
    for cls in (row_shard.RowShard, row_shard.NestedRowShard):
        own_eq = cls.__eq__

        def __eq__(self, other, own_eq=own_eq, kinds=(row_shard.RowShard, row_shard.NestedRowShard)):
            if hasattr(other, "rows") and not isinstance(other, kinds):
                return False  # a row shard of another engine copy
            return own_eq(self, other)

        cls.__eq__ = __eq__  # (its own __hash__ stays: assigning __eq__ later keeps it)
