#!/usr/bin/env bash
# The whole test suite: single-process unit tests, then the distributed tests under
# torch.distributed.run with gloo at 2 and 4 ranks, then the functional (end-to-end) tests.
# Every stage has an outer time limit so a hung rank can never hang CI.
set -euo pipefail
cd "$(dirname "$0")/.."
# The test extras: everything the tests import (transformers, safetensors, TensorBoard, ...).
MEGATRON_EXTRAS=test source scripts/setup_env.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export WANDB_MODE=offline
export PYTHONUNBUFFERED=1
logs="$(mktemp -d)"
status=0

echo "=== unit tests (single process) ==="
timeout 900 python -m pytest -q -p no:cacheprovider tests/unit_tests \
    --ignore=tests/unit_tests/distributed || status=1

for nproc in 2 4; do
    echo "=== distributed tests: gloo, $nproc ranks ==="
    # Rank 0 is shown on the console; every rank's full log lands in $logs/$nproc.
    if ! timeout 1800 python -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
        --log-dir "$logs/$nproc" --redirects 3 --tee 3 --local-ranks-filter 0 \
        -m pytest -q -p no:cacheprovider tests/unit_tests/distributed; then
        status=1
        echo "--- distributed tests failed at $nproc ranks; tails of the other ranks' logs:"
        find "$logs/$nproc" -name 'stdout.log' | sort | while read -r f; do
            echo "----- $f"; tail -n 30 "$f"
        done
    fi
done

if [ -d tests/functional_tests ] && ls tests/functional_tests/test_*.py >/dev/null 2>&1; then
    echo "=== functional tests ==="
    timeout 1800 python -m pytest -q -p no:cacheprovider tests/functional_tests || status=1
fi

if [ "$status" -ne 0 ]; then
    echo "Some test stage failed (see above)."
fi
exit "$status"
