#!/usr/bin/env bash
# Run upstream Megatron-LM's public MFSDP v2 tests (test_context.py, test_fully_shard.py,
# test_checkpoint.py) against this package on CPU/gloo. A developer tool, not part of CI:
# it needs an upstream checkout, and no upstream code is kept in this repository.
#
#   scripts/run_upstream_mfsdp_tests.sh UPSTREAM_GIT_DIR [NPROC] [PYTEST_ARGS...]
#
# UPSTREAM_GIT_DIR is any git dir of Megatron-LM (a bare mirror is fine); its HEAD is read.
# NPROC defaults to 4. Extra arguments go to pytest (e.g. -k hsdp). The engine under test
# is this checkout's, or the one in MFSDP_REPO (another checkout; nothing is written to it).
# Prints one line per test (its worst outcome over the ranks) and the counts; exits 1 if
# any test failed. MFSDP_UPSTREAM_KEEP_LOGS=DIR keeps every rank's log.
# See docs/mfsdp_v2.md, "Running upstream's tests".
set -euo pipefail
if [ $# -lt 1 ]; then
    sed -n '2,13p' "$0"; exit 2
fi
upstream="$1"; nproc="${2:-4}"; shift; [ $# -gt 0 ] && shift
here="$(cd "$(dirname "$0")/.." && pwd)"
repo="$(cd "${MFSDP_REPO:-$here}" && pwd)"
work="$(mktemp -d -t mfsdp_upstream_XXXX)"
trap 'rm -rf "$work"' EXIT

python "$here/scripts/upstream_mfsdp/prepare.py" export "$upstream" "$work"
mkdir "$work/results"
cd "$work"
# Hide CUDA so upstream's conftest picks the CPU and init_device_mesh uses gloo.
# Every rank's log is kept in $work/logs while the run lasts; rank 0 is shown.
status=0
CUDA_VISIBLE_DEVICES="" PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" \
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MFSDP_UPSTREAM_RESULTS="$work/results" \
    timeout "${MFSDP_UPSTREAM_TIMEOUT:-600}" python -m torch.distributed.run --standalone \
    --nproc-per-node "$nproc" --log-dir "$work/logs" --redirects 3 --tee 3 --local-ranks-filter 0 \
    -m pytest -q -p no:cacheprovider -c "$work/pytest.ini" --rootdir "$work" --timeout 120 --tb=short \
    mfsdp_v2/test_context.py mfsdp_v2/test_fully_shard.py mfsdp_v2/test_checkpoint.py "$@" \
    || status=$?
echo "=== upstream MFSDP v2 tests, gloo, $nproc ranks (pytest/torchrun exit $status) ==="
if [ -n "${MFSDP_UPSTREAM_KEEP_LOGS:-}" ]; then
    cp -r "$work/logs" "$MFSDP_UPSTREAM_KEEP_LOGS"
    echo "per-rank logs copied to $MFSDP_UPSTREAM_KEEP_LOGS"
fi
python "$here/scripts/upstream_mfsdp/prepare.py" summary "$work/results"
