#!/usr/bin/env bash
# The whole test suite: single-process unit tests, then the distributed tests under
# torch.distributed.run with gloo at 2 and 4 ranks, then the functional (end-to-end) tests,
# then a sample of upstream Megatron-LM's functional-test lines trained at their own layouts,
# then the distributed tests at 2 ranks once more on the newest torch the project runs on
# (MEGATRON_NEXT_TORCH, default torch==2.14.1, in a venv of its own: .venv-torch214), then the
# documented commands (scripts/run_doc_commands.py: every command block of README.md, docs/ and
# examples/README.md, in a fresh copy of the tree, long runs shortened by MEGATRON_MAX_TRAIN_ITERS).
# Every stage has an outer time limit so a hung rank can never hang CI; each stage's wall
# time is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
# The test extras: everything the tests import (transformers, safetensors, TensorBoard, ...).
MEGATRON_EXTRAS=test source scripts/setup_env.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export WANDB_MODE=offline
export PYTHONUNBUFFERED=1
next_torch="${MEGATRON_NEXT_TORCH:-torch==2.14.1}"
logs="$(mktemp -d)"
status=0
times=()

# stage NAME COMMAND...: run, remember the wall time, note a failure without stopping.
stage() {
    local name="$1" start=$SECONDS
    shift
    echo "=== $name ==="
    "$@" || status=1
    times+=("$(printf '%-52s %5d s' "$name" $((SECONDS - start)))")
}

# distributed NPROC LOGNAME: the distributed tests at NPROC ranks. Rank 0 is shown on the
# console; every rank's full log lands in $logs/LOGNAME, and a failure shows the others' tails.
distributed() {
    local nproc="$1" name="$2"
    # 50 minutes, a hang guard: the 4-rank stage takes ~5.5 on this 2-core box (it took 50 while
    # the tests left their gloo groups alive: see tests/unit_tests/distributed/conftest.py).
    if ! timeout 3000 python -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
        --log-dir "$logs/$name" --redirects 3 --tee 3 --local-ranks-filter 0 \
        -m pytest -q -p no:cacheprovider tests/unit_tests/distributed; then
        echo "--- distributed tests failed ($name); tails of the other ranks' logs:"
        find "$logs/$name" -name 'stdout.log' | sort | while read -r f; do
            echo "----- $f"; tail -n 30 "$f"
        done
        return 1
    fi
}

# The venv of $next_torch (a subshell: the suite's venv stays active). Creating it downloads
# and unpacks a ~5 GB wheel: I/O, not CPU, so it runs in the background from the start,
# beside the CPU-bound stages, instead of adding minutes of its own.
prepare_next_torch() {
    (
        MEGATRON_VENV="$PWD/.venv-torch214" MEGATRON_TORCH="$next_torch" MEGATRON_EXTRAS=test \
            source scripts/setup_env.sh
    )
}
prepare_next_torch >"$logs/next-torch-setup.log" 2>&1 &
next_torch_setup=$!

# The same distributed tests on $next_torch, in its own venv.
distributed_next_torch() {
    if ! wait "$next_torch_setup"; then
        echo "--- creating the $next_torch venv failed:"; cat "$logs/next-torch-setup.log"
        return 1
    fi
    cat "$logs/next-torch-setup.log"
    (
        MEGATRON_VENV="$PWD/.venv-torch214" MEGATRON_TORCH="$next_torch" MEGATRON_EXTRAS=test \
            source scripts/setup_env.sh || exit 1
        python -c "import torch; print('torch', torch.__version__)"
        distributed 2 next-torch
    )
}

stage "unit tests (single process)" \
    timeout 900 python -m pytest -q -p no:cacheprovider tests/unit_tests --ignore=tests/unit_tests/distributed
stage "distributed tests: gloo, 2 ranks" distributed 2 2
stage "distributed tests: gloo, 4 ranks" distributed 4 4
if [ -d tests/functional_tests ] && ls tests/functional_tests/test_*.py >/dev/null 2>&1; then
    stage "functional tests" timeout 1800 python -m pytest -q -p no:cacheprovider tests/functional_tests
fi
# Upstream's command lines (tests/upstream_lines): the parse replay of all its GPT and MoE
# functional-test lines and examples/ scripts, and 24 of those lines trained 3 iterations
# each at their own TP/PP/CP/EP on 2-8 ranks. 30 minutes, a hang guard (each line also has
# its own 300 s): the training took 18 at a load of 20 on this 2-core box, 8.2 CPU-minutes.
stage "upstream's command lines (replayed, 24 trained at their own layouts)" \
    timeout 1800 python -m pytest -q -p no:cacheprovider --durations=0 tests/upstream_lines
stage "distributed tests: gloo, 2 ranks, $next_torch" distributed_next_torch
# 25 minutes, a hang guard (each block also has its own, its marker's timeout=): on this 2-core
# box the stage took 5 minutes at a load of 7-13 and 10 at 22-26, for 2.4 CPU-minutes.
stage "documented commands (README, docs/, examples/)" timeout 1500 python scripts/run_doc_commands.py

echo "=== wall time per stage ==="
printf '%s\n' "${times[@]}"
if [ "$status" -ne 0 ]; then
    echo "Some test stage failed (see above)."
fi
exit "$status"
