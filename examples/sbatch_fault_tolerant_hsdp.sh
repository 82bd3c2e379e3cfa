#!/usr/bin/env bash
# Fault-tolerant HSDP under SLURM (torchft): one job step runs the lighthouse, and each of
# the G replica groups is a job step of its own (NODES_PER_GROUP nodes, one task per GPU,
# ranks from SLURM's environment as in sbatch_gpt2_multinode.sh). A rank that dies ends
# only its group's step (--kill-on-bad-exit=1); the other groups train on ("ft: group 0:
# quorum 1 of 2"), and this script starts the dead group's step again, which rejoins with
# the live weights of a healthy group. --no-kill keeps the allocation when a node fails.
#
#   sbatch examples/sbatch_fault_tolerant_hsdp.sh                     # 2 groups x 1 node
#   sbatch --nodes 4 --export=ALL,NUM_GROUPS=4 examples/sbatch_fault_tolerant_hsdp.sh
#
# Create the environment once, from a login node, with the ft extra:
#   login$ MEGATRON_EXTRAS=ft source scripts/setup_env.sh
# (an environment already active when the script starts is used as it is).
#
#SBATCH --job-name=mfsdp-ft-hsdp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
#SBATCH --no-kill
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
if [ -z "${VIRTUAL_ENV:-}" ]; then
    MEGATRON_EXTRAS="${MEGATRON_EXTRAS:-ft}" source scripts/setup_env.sh
fi

OUT="${OUT:-runs/ft_hsdp_${SLURM_JOB_ID:-local}}"
NODES="${SLURM_JOB_NUM_NODES:-2}"
NUM_GROUPS="${NUM_GROUPS:-$NODES}"               # G replica groups
NODES_PER_GROUP="${NODES_PER_GROUP:-$((NODES / NUM_GROUPS))}"
TASKS_PER_NODE="${SLURM_NTASKS_PER_NODE:-8}"
MIN_GROUPS="${MIN_GROUPS:-1}"                    # K: a step commits with at least K live groups
MAX_RESTARTS="${MAX_RESTARTS:-3}"                # per group, then it stays down
PORT="${LIGHTHOUSE_PORT:-29510}"
MICRO_BATCH="${MICRO_BATCH:-8}"
GLOBAL_BATCH="${GLOBAL_BATCH:-$((MICRO_BATCH * TASKS_PER_NODE * NODES_PER_GROUP * NUM_GROUPS))}"
TRAIN_ITERS="${TRAIN_ITERS:-20000}"
# The model and data: MODEL_ARGS (one string, word-split) replaces this default, which
# needs DATA_PATH.
if [ -z "${MODEL_ARGS:-}" ]; then
    MODEL_ARGS="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 \
--max-position-embeddings 2048 --position-embedding-type rope --normalization RMSNorm --swiglu \
--disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0 \
--optimizer adam --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 \
--weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --log-interval 10 --eval-iters 0 \
--data-path ${DATA_PATH:?set DATA_PATH to a prefix written by tools/preprocess_data.py} --split 969,30,1 \
--tokenizer-type GPT2BPETokenizer --num-workers 4 --bf16 --distributed-backend nccl"
fi
if [ $((NODES_PER_GROUP * NUM_GROUPS)) -gt "$NODES" ] || [ "$NODES_PER_GROUP" -lt 1 ]; then
    echo "error: $NUM_GROUPS groups x $NODES_PER_GROUP nodes do not fit the job's $NODES nodes;" \
        "set NUM_GROUPS / NODES_PER_GROUP or sbatch --nodes." >&2
    exit 2
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
export RUST_LOG="${RUST_LOG:-warn}"  # torchft's Rust side logs every quorum at info
mkdir -p "$OUT"

# The lighthouse: a one-task step on the first node, beside that node's group (--overlap).
LIGHTHOUSE_HOST="$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" | head -n 1)"
export TORCHFT_LIGHTHOUSE="http://$LIGHTHOUSE_HOST:$PORT"
srun --nodes 1 --ntasks 1 --relative 0 --overlap --cpus-per-task 1 --gpus 0 --kill-on-bad-exit=1 \
    torchft_lighthouse --bind "[::]:$PORT" --min_replicas "$MIN_GROUPS" --join_timeout_ms 60000 \
    --heartbeat_timeout_ms 5000 >"$OUT/lighthouse.log" 2>&1 &
lighthouse=$!
for _ in $(seq 300); do (exec 3<>"/dev/tcp/$LIGHTHOUSE_HOST/$PORT") 2>/dev/null && break; sleep 0.2; done

run_group() {  # replica group $1: its own step on its nodes, started again when it fails
    local g="$1" restarts=0
    while true; do
        # shellcheck disable=SC2086
        if srun --nodes "$NODES_PER_GROUP" --ntasks $((NODES_PER_GROUP * TASKS_PER_NODE)) \
            --ntasks-per-node "$TASKS_PER_NODE" --relative $((g * NODES_PER_GROUP)) --kill-on-bad-exit=1 \
            python pretrain_gpt.py $MODEL_ARGS \
            --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS" \
            --use-mfsdp --data-parallel-sharding-strategy optim_grads_params \
            --ft-replica-group-id "$g" --ft-num-replica-groups "$NUM_GROUPS" \
            --ft-min-replica-groups "$MIN_GROUPS" --ft-lighthouse "$TORCHFT_LIGHTHOUSE" \
            --log-dir "$OUT/logs/group$g" \
            >>"$OUT/group$g.log" 2>&1; then
            return 0
        fi
        restarts=$((restarts + 1))
        if [ "$restarts" -gt "$MAX_RESTARTS" ]; then
            echo "group $g: failed $restarts times, left down (MAX_RESTARTS=$MAX_RESTARTS)"
            return 1
        fi
        echo "group $g: its step failed; starting it again ($restarts of $MAX_RESTARTS): it rejoins the quorum"
    done
}

groups=()
for g in $(seq 0 $((NUM_GROUPS - 1))); do
    run_group "$g" &
    groups+=($!)
done
status=0
for pid in "${groups[@]}"; do wait "$pid" || status=1; done
kill "$lighthouse" 2>/dev/null || true
wait "$lighthouse" 2>/dev/null || true
exit "$status"
