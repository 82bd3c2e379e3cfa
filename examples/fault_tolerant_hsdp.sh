#!/usr/bin/env bash
# Fault-tolerant HSDP on one machine: a torchft lighthouse and G replica groups, each its own
# torchrun of pretrain_gpt.py (MFSDP ZeRO-3 inside a group; the replica dimension is
# torchft's). Kill any group's rank (or the whole torchrun) while it trains: the other groups
# go on ("ft: group 0: quorum 1 of 2"); start that group again with the command the script
# prints and it joins with the live weights of a healthy group (same "weights sha256" lines).
#
#   bash examples/fault_tolerant_hsdp.sh                  # 2 groups x 2 ranks, mock data
#   NUM_GROUPS=3 RANKS=1 TRAIN_ITERS=2000 bash examples/fault_tolerant_hsdp.sh
#
# Needs the ft extra: MEGATRON_EXTRAS=ft source scripts/setup_env.sh (torchft==0.2.0).
set -euo pipefail
cd "$(dirname "$0")/.."
MEGATRON_EXTRAS="${MEGATRON_EXTRAS:-ft}" source scripts/setup_env.sh

OUT="${OUT:-runs/fault_tolerant_hsdp}"
NUM_GROUPS="${NUM_GROUPS:-2}"              # G replica groups
RANKS="${RANKS:-2}"                # ranks per group (each group's own MFSDP mesh)
MIN_GROUPS="${MIN_GROUPS:-1}"      # K: a step commits with at least K live groups
TRAIN_ITERS="${TRAIN_ITERS:-300}"
PORT="${LIGHTHOUSE_PORT:-29510}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export WANDB_MODE="${WANDB_MODE:-offline}"
export TORCHFT_LIGHTHOUSE="http://localhost:$PORT"
export RUST_LOG="${RUST_LOG:-warn}"  # torchft's Rust side logs every quorum at info
mkdir -p "$OUT"

# The lighthouse: --min_replicas K groups form a quorum; a group silent for
# --heartbeat_timeout_ms is dropped from the next quorum.
torchft_lighthouse --bind "[::]:$PORT" --min_replicas "$MIN_GROUPS" --join_timeout_ms 10000 \
    --heartbeat_timeout_ms 2000 >"$OUT/lighthouse.log" 2>&1 &
lighthouse=$!
pids=()
cleanup() { kill "${pids[@]}" "$lighthouse" 2>/dev/null || true; pkill -P $$ 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break; sleep 0.2; done

group_command() {  # the command line of replica group $1 (its own torchrun, its own free port)
    echo python -m torch.distributed.run --standalone --nproc-per-node "$RANKS" pretrain_gpt.py \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
        --micro-batch-size 2 --global-batch-size $((2 * RANKS * NUM_GROUPS)) \
        --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10 --clip-grad 1.0 \
        --train-iters "$TRAIN_ITERS" --log-interval 10 --eval-iters 0 \
        --mock-data --tokenizer-type NullTokenizer --vocab-size 256 --num-workers 0 --seed 1234 \
        --use-mfsdp --data-parallel-sharding-strategy optim_grads_params \
        --ft-replica-group-id "$1" --ft-num-replica-groups "$NUM_GROUPS" --ft-min-replica-groups "$MIN_GROUPS"
}

for g in $(seq 0 $((NUM_GROUPS - 1))); do
    $(group_command "$g") >"$OUT/group$g.log" 2>&1 &
    pids+=($!)
    echo "group $g: torchrun pid $!, log $OUT/group$g.log; restart it with:"
    echo "  TORCHFT_LIGHTHOUSE=$TORCHFT_LIGHTHOUSE $(group_command "$g") >>$OUT/group$g.log 2>&1 &"
done
echo "following the ft lines (Ctrl-C stops everything; restart commands run from $(pwd)):"
followers=()
for g in $(seq 0 $((NUM_GROUPS - 1))); do
    tail -n +1 -F "$OUT/group$g.log" 2>/dev/null | grep --line-buffered "^ft:" | sed -u "s/^/[group $g] /" &
    followers+=($!)
done
wait "${pids[@]}" || true
sleep 1  # let the followers print the last lines
kill "${followers[@]}" 2>/dev/null || true
