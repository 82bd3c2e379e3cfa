"""Export upstream Megatron-LM's MFSDP v2 tests and point them at this package.

    python scripts/upstream_mfsdp/prepare.py export UPSTREAM_GIT_DIR WORK_DIR
    python scripts/upstream_mfsdp/prepare.py summary RESULTS_DIR

`export` reads the test files from UPSTREAM_GIT_DIR's HEAD with `git show` (nothing of
upstream is vendored here), applies the textual rewrites in REWRITES, checks that each
rewrite still matches and that no reference to upstream's package is left, and lays out
WORK_DIR as a small pytest tree whose root conftest is ours (shim/root_conftest.py).
`summary` merges the per-rank result files the shim writes into one line per test.
"""

import json
import pathlib
import shutil
import subprocess
import sys

UPSTREAM_TEST_DIR = "tests/unit_tests/distributed/mfsdp_v2"
TEST_FILES = ("test_context.py", "test_fully_shard.py", "test_checkpoint.py")
# Upstream's own conftest is used as is: it picks the CPU when CUDA is not visible,
# and the runner hides CUDA.
UPSTREAM_SUPPORT_FILES = ("conftest.py",)

# (old, new, why). Every rule must match somewhere, so a change upstream that makes a
# rule stale stops the export instead of silently testing something else.
REWRITES = (
    (
        "megatron.core.distributed.fsdp.src.megatron_fsdp.experimental",
        "megatron.core.distributed.mfsdp_v2",
        "upstream's engine package is ours (the .module submodule keeps its name)",
    ),
    (
        "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
        "megatron.core.distributed.mfsdp_v2.mixed_precision",
        "MixedPrecisionPolicy lives in our package",
    ),
    (
        "from tests.unit_tests.distributed.mfsdp_v2.profiler_utils import",
        "from profiler_utils import",
        "our profiler_utils counts gloo collectives where upstream counts NCCL kernels",
    ),
    (
        "from tests.unit_tests.dist_checkpointing import TempNamedDir",
        "from upstream_helpers import TempNamedDir",
        "our stand-in for upstream's shared checkpoint directory helper",
    ),
    (
        "torch.cuda.synchronize(device)",
        "torch.cpu.synchronize(device)",
        "the device is the CPU; its synchronize is a no-op",
    ),
)
# After the rewrites, none of these may appear in an exported file.
FORBIDDEN = ("megatron_fsdp", "tests.unit_tests")

SHIM_DIR = pathlib.Path(__file__).resolve().parent / "shim"


def _git_show(git_dir: str, path: str) -> str:
    result = subprocess.run(
        ["git", "-C", git_dir, "show", f"HEAD:{path}"], capture_output=True, text=True
    )
    if result.returncode != 0:
        sys.exit(f"cannot read {path} from {git_dir}: {result.stderr.strip()}")
    return result.stdout


def export(git_dir: str, work_dir: str) -> None:
    work = pathlib.Path(work_dir)
    tests = work / "mfsdp_v2"
    tests.mkdir(parents=True, exist_ok=True)
    hits = {old: 0 for old, _, _ in REWRITES}
    for name in TEST_FILES + UPSTREAM_SUPPORT_FILES:
        text = _git_show(git_dir, f"{UPSTREAM_TEST_DIR}/{name}")
        for old, new, _ in REWRITES:
            hits[old] += text.count(old)
            text = text.replace(old, new)
        left = [word for word in FORBIDDEN if word in text]
        if left:
            sys.exit(f"{name}: {left} still referenced after the rewrites; add a rule")
        (tests / name).write_text(text)
    stale = [old for old, count in hits.items() if count == 0]
    if stale:
        sys.exit(f"rewrite rules that matched nothing (upstream changed?): {stale}")
    # Our shim: the root conftest, and the helpers the rewritten imports name.
    shutil.copy(SHIM_DIR / "root_conftest.py", work / "conftest.py")
    for helper in ("profiler_utils.py", "upstream_helpers.py"):
        shutil.copy(SHIM_DIR / helper, tests / helper)
    (work / "pytest.ini").write_text("[pytest]\n")
    commit = subprocess.run(
        ["git", "-C", git_dir, "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(f"exported {len(TEST_FILES)} test files from upstream {commit} into {tests}")


def summary(results_dir: str) -> int:
    """Print one line per test with its outcome on every rank; return 1 if any failed."""
    per_rank = {}
    for path in sorted(pathlib.Path(results_dir).glob("rank*.json")):
        per_rank[int(path.stem[len("rank"):])] = json.loads(path.read_text())
    if not per_rank:
        print(f"no per-rank results in {results_dir} (did pytest start?)")
        return 1
    ranks = sorted(per_rank)
    tests = sorted({test for results in per_rank.values() for test in results})
    counts = {}
    for test in tests:
        outcomes = [per_rank[rank].get(test, {}).get("outcome", "missing") for rank in ranks]
        # A test passes only if it passes on every rank; otherwise report the worst rank.
        for worst in ("error", "failed", "missing", "skipped", "passed"):
            if worst in outcomes:
                break
        counts[worst] = counts.get(worst, 0) + 1
        message = next(
            (per_rank[rank][test].get("message", "") for rank in ranks
             if per_rank[rank].get(test, {}).get("outcome") == worst),
            "",
        )
        print(f"{worst:8s} {test}" + (f"  -- {message}" if worst != "passed" else ""))
    print(f"ranks {len(ranks)}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0 if set(counts) <= {"passed"} else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "export":
        export(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "summary":
        sys.exit(summary(sys.argv[2]))
    else:
        sys.exit(__doc__)
