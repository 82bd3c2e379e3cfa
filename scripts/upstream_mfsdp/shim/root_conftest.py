"""Root conftest of the exported tree (copied in as conftest.py) for upstream's MFSDP v2
tests run against this package. Not part of CI.

It stands in for what upstream's top-level tests/unit_tests/conftest.py gives those tests,
on CPU/gloo:

- the process group: our distributed-test conftest is loaded as a plugin, so the world is
  gloo with a 60 s timeout, and every test starts and ends with all ranks together and the
  same RNG state (upstream's files would otherwise let init_device_mesh create the group
  with the default 30 min timeout);
- ``tmp_path_dist_ckpt``: one directory shared by all ranks;
- a per-rank record of every test's outcome, $MFSDP_UPSTREAM_RESULTS/rank<R>.json, which
  ``prepare.py summary`` merges.
"""

import json
import os
import pathlib
import shutil
import tempfile

import pytest
import torch.distributed as dist

pytest_plugins = ["tests.unit_tests.distributed.conftest"]


@pytest.fixture
def tmp_path_dist_ckpt():
    """A fresh directory that every rank sees at the same path."""
    name = [tempfile.mkdtemp(prefix="mfsdp_upstream_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    yield pathlib.Path(name[0])
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(name[0], ignore_errors=True)


_outcomes = {}


def pytest_runtest_logreport(report):
    test = report.nodeid.split("/")[-1]
    if report.when == "call" or report.outcome != "passed":
        outcome = report.outcome
        if report.when != "call" and report.failed:
            outcome = "error"
        if test in _outcomes and _outcomes[test]["outcome"] != "passed":
            return  # keep the first failure (a failing call's teardown adds nothing)
        message = ""
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:
            message = crash.message.splitlines()[0][:300]
        elif isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
            message = str(report.longrepr[2])[:300]
        _outcomes[test] = {"outcome": outcome, "message": message}
        _write_outcomes()


def pytest_collectreport(report):
    if report.failed:  # e.g. an import the rewrites did not cover
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message.splitlines()[0][:300] if crash is not None else str(report.longrepr)[:300]
        _outcomes[report.nodeid.split("/")[-1] + " (collection)"] = {"outcome": "error", "message": message}
        _write_outcomes()


def _write_outcomes():
    # After every test, so a run killed by a hang still leaves what finished before it.
    results_dir = os.environ.get("MFSDP_UPSTREAM_RESULTS")
    if results_dir:
        rank = os.environ.get("RANK", "0")
        pathlib.Path(results_dir, f"rank{rank}.json").write_text(json.dumps(_outcomes, indent=1))
