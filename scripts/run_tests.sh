#!/usr/bin/env bash
# The whole test suite: single-process unit tests, then the distributed tests under
# torch.distributed.run with gloo at 2 and 4 ranks, then the functional (end-to-end) tests,
# beside the distributed tests at 2 ranks once more on the newest torch the project runs on
# (MEGATRON_NEXT_TORCH, default torch==2.14.1, in a venv of its own: .venv-torch214), then a
# sample of upstream Megatron-LM's functional-test lines trained at their own layouts beside the
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

# beside NAME COMMAND...: the same, in the background, beside the stages that follow, its
# output kept in a file and shown at `joined`. Why: some stages keep about one of the two
# cores busy (the single-process tests; the end-to-end launches, whose ranks wait on each
# other), and the distributed ones leave a quarter idle (a rank waiting in a collective), so
# a stage beside another finishes in the gaps instead of after it.
beside_name=""
beside_pid=""
beside() {
    beside_name="$1"
    shift
    echo "=== $beside_name (in the background; its output follows when it ends) ==="
    (
        start=$SECONDS
        rc=0
        "$@" >"$logs/beside.log" 2>&1 || rc=$?
        echo "$((SECONDS - start))" >"$logs/beside.seconds"
        exit "$rc"
    ) &
    beside_pid=$!
}

joined() {
    local rc=0
    wait "$beside_pid" || rc=1
    echo "=== $beside_name (ran in the background) ==="
    cat "$logs/beside.log"
    [ "$rc" -eq 0 ] || status=1
    times+=("$(printf '%-52s %5d s (beside the stage above)' "$beside_name" "$(cat "$logs/beside.seconds")")")
}

# distributed NPROC LOGNAME: the distributed tests at NPROC ranks. Rank 0 is shown on the
# console; every rank's full log lands in $logs/LOGNAME, and a failure shows the others' tails.
distributed() {
    local nproc="$1" name="$2"
    # 50 minutes, a hang guard: the 4-rank stage takes 4-6.5 on this 2-core box (it took 50 while
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

beside "unit tests (single process)" \
    timeout 900 python -m pytest -q -p no:cacheprovider tests/unit_tests --ignore=tests/unit_tests/distributed
stage "distributed tests: gloo, 2 ranks" distributed 2 2
joined
stage "distributed tests: gloo, 4 ranks" distributed 4 4
beside "functional tests" timeout 1800 python -m pytest -q -p no:cacheprovider tests/functional_tests
stage "distributed tests: gloo, 2 ranks, $next_torch" distributed_next_torch
joined
# Upstream's command lines (tests/upstream_lines): the parse replay of all its GPT and MoE
# functional-test lines and examples/ scripts, and 24 of those lines trained 3 iterations
# each at their own TP/PP/CP/EP on 2-8 ranks. 30 minutes, a hang guard (each line also has
# its own 300 s): the stage takes 2-3 on this 2-core box (the lines' ranks forked from one
# process that imported the trainer once: tests/functional_tests/forked_launch.py).
beside "upstream's command lines (replayed, 24 trained at their own layouts)" \
    timeout 1800 python -m pytest -q -p no:cacheprovider --durations=0 tests/upstream_lines
# 25 minutes, a hang guard (each block also has its own, its marker's timeout=): on this 2-core
# box the stage took 5 minutes at a load of 7-13 and 10 at 22-26, for 2.4 CPU-minutes.
stage "documented commands (README, docs/, examples/)" timeout 1500 python scripts/run_doc_commands.py
joined

echo "=== wall time per stage ==="
printf '%s\n' "${times[@]}"
printf '%-52s %5d s\n' "all stages, with the set-up" "$SECONDS"
if [ "$status" -ne 0 ]; then
    echo "Some test stage failed (see above)."
fi
exit "$status"
