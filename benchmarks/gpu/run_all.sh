#!/usr/bin/env bash
# GPU checks for MFSDP v2 on ONE NVIDIA GPU at world size 1; all figures into one JSON.
#
#   bash benchmarks/gpu/run_all.sh [OUT_DIR]        # default: $OUT if set, else benchmarks/results/gpu
#   bash benchmarks/gpu/run_all.sh --cpu-dry-run    # no GPU: tiny sizes on CPU/gloo, CUDA-only parts skipped
#
# Budget: under 8 minutes in total (every stage has its own time limit, and the whole
# script stops at 7m30s). Stages:
#   0. the stream protocol on simulated streams (CPU/gloo, 2 ranks, the stream checker):
#      the protocol the GPU is about to run, checked first (under 2 minutes)
#   1. the engine's CUDA tests: pytest -m cuda over tests/unit_tests (if any are marked)
#   2. gpu_checks.py: CUDA parity (engine on CUDA vs unwrapped reference and vs the engine
#      on CPU/gloo), prefetch overlap from a profiler trace, bf16 with fp32 main weights,
#      Transformer Engine (if importable), MFU of a ~1B GPT: MFSDP v2 vs FSDP2 vs no wrapper.
# Result: OUT_DIR/gpu_results.json (+ the overlap profiler trace and the pytest log).
set -uo pipefail
cd "$(dirname "$0")/../.."
repo="$(pwd)"

dry_run=0
if [ "${1:-}" = "--cpu-dry-run" ]; then
    dry_run=1
    shift
fi
out_dir="${1:-${OUT:-$repo/benchmarks/results/gpu}}"
mkdir -p "$out_dir"
json="$out_dir/gpu_results.json"

if [ -f scripts/setup_env.sh ] && [ -z "${VIRTUAL_ENV:-}" ] && ! python -c "import torch" 2>/dev/null; then
    # shellcheck disable=SC1091
    source scripts/setup_env.sh
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
deadline=$((SECONDS + 450))   # 7m30s for everything
left() { local l=$((deadline - SECONDS)); [ "$l" -lt 10 ] && l=10; echo "$l"; }

if [ "$dry_run" -eq 1 ]; then
    device_args=(--device cpu --tiny)
    echo "[run_all] CPU dry run (tiny sizes; CUDA-only checks are skipped)"
else
    if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "[run_all] no CUDA device visible; use --cpu-dry-run on a machine without a GPU" >&2
        exit 2
    fi
    device_args=(--device cuda)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi

status=0
echo "=== 0. stream protocol on simulated streams (stream checker, CPU, 2 ranks) ==="
streams_log="$out_dir/stream_protocol.log"
OMP_NUM_THREADS=1 timeout 120 python -m torch.distributed.run --standalone --nproc-per-node 2 \
    --local-ranks-filter 0 -m pytest -q -p no:cacheprovider \
    tests/unit_tests/distributed/strategies/test_strategy_streams.py >"$streams_log" 2>&1
streams_rc=$?
tail -n 2 "$streams_log"
if [ "$streams_rc" -ne 0 ]; then status=1; fi

echo "=== 1. engine CUDA tests (pytest -m cuda) ==="
pytest_log="$out_dir/pytest_cuda.log"
if [ "$dry_run" -eq 1 ]; then
    echo "skipped in the CPU dry run" | tee "$pytest_log"
    pytest_rc=-1
else
    timeout 150 python -m pytest -q -p no:cacheprovider -m cuda tests/unit_tests >"$pytest_log" 2>&1
    pytest_rc=$?
    tail -n 5 "$pytest_log"
    # 5 = no test is marked cuda (nothing to run): not a failure.
    if [ "$pytest_rc" -ne 0 ] && [ "$pytest_rc" -ne 5 ]; then status=1; fi
fi

echo "=== 2. gpu_checks.py (parity, overlap, bf16, te, mfu) ==="
timeout "$(left)" python -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/gpu/gpu_checks.py "${device_args[@]}" --out "$json"
checks_rc=$?
if [ "$checks_rc" -ne 0 ]; then status=1; fi

# Record the pytest stages in the same JSON.
python - "$json" "$pytest_rc" "$pytest_log" "$streams_rc" "$streams_log" <<'PY'
import json, os, sys
path, rc, log, streams_rc, streams_log = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
data = json.load(open(path)) if os.path.exists(path) else {"checks": {}}
meaning = {0: "passed", 5: "no tests marked cuda", -1: "skipped (CPU dry run)", 124: "timed out"}


def tail(name):
    return open(name).read().splitlines()[-5:] if os.path.exists(name) else []


data["cuda_tests"] = {"pytest_exit_code": rc, "result": meaning.get(rc, "failed"), "log_tail": tail(log)}
data["stream_protocol"] = {"pytest_exit_code": streams_rc, "result": meaning.get(streams_rc, "failed"),
                           "log_tail": tail(streams_log)}
json.dump(data, open(path, "w"), indent=1)
PY
echo "[run_all] figures: $json (exit $status, ${SECONDS}s)"
exit "$status"
