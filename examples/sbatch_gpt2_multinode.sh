#!/usr/bin/env bash
# Multi-node MFSDP training under SLURM: one task per GPU, launched by srun. Every task
# finds its rank, the world size and the rendezvous host (the first node of the job) in
# SLURM's environment (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_NODELIST), so
# no torchrun is needed. The rendezvous port is derived from the job and step ids.
#
# Create the environment ONCE, on shared storage, from a login node (compute nodes often
# have no internet access, and concurrent installs into one venv corrupt it):
#   login$ source scripts/setup_env.sh      # the venv lands in the repository, on shared storage
#
#   sbatch examples/sbatch_gpt2_multinode.sh
#   sbatch --nodes 8 examples/sbatch_gpt2_multinode.sh          # more nodes, same script
#
# Preemption and time limits: SLURM sends SIGUSR1 three minutes before the end
# (--signal); every rank finishes its iteration, a checkpoint is saved and the step exits
# 0 (--exit-signal-handler --exit-signal SIGUSR1). If training is not finished the job
# requeues itself (--requeue) and resumes from the latest checkpoint (--load = --save).
#
#SBATCH --job-name=mfsdp-gpt2
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=USR1@180
#SBATCH --requeue
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
source scripts/setup_env.sh

OUT="${OUT:-runs/gpt2_multinode_${SLURM_JOB_ID:-local}}"
GPUS_PER_NODE="${SLURM_NTASKS_PER_NODE:-8}"
NODES="${SLURM_JOB_NUM_NODES:-1}"
# HSDP: one model replica per node (ZeRO-3 inside the node over NVLink, replicas across
# nodes over the slower network). Set INSTANCES=1 for plain ZeRO-3 over all GPUs.
INSTANCES="${INSTANCES:-$NODES}"
MICRO_BATCH="${MICRO_BATCH:-8}"
GLOBAL_BATCH="${GLOBAL_BATCH:-$((MICRO_BATCH * GPUS_PER_NODE * NODES * 2))}"
DATA_PATH="${DATA_PATH:?set DATA_PATH to a prefix written by tools/preprocess_data.py}"

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
TRAIN_ITERS="${TRAIN_ITERS:-20000}"
# MASTER_PORT defaults to one derived from the job and step ids; MASTER_ADDR to the
# step's first node.

# --kill-on-bad-exit=1: one failing rank ends the step instead of leaving the rest hanging.
# shellcheck disable=SC2086
srun --kill-on-bad-exit=1 python pretrain_gpt.py \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 \
    --max-position-embeddings 2048 --position-embedding-type rope --normalization RMSNorm --swiglu \
    --disable-bias-linear --untie-embeddings-and-output-weights \
    --hidden-dropout 0.0 --attention-dropout 0.0 \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" \
    --optimizer adam --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 \
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
    --train-iters "$TRAIN_ITERS" --log-interval 10 --eval-interval 1000 --eval-iters 20 \
    --data-path $DATA_PATH --split 969,30,1 --tokenizer-type GPT2BPETokenizer --num-workers 4 \
    --bf16 --use-mfsdp --data-parallel-sharding-strategy optim_grads_params \
    --num-distributed-optimizer-instances "$INSTANCES" --outer-dp-sharding-strategy no_shard \
    --distributed-backend nccl --distributed-timeout-minutes 30 \
    --log-throughput --log-dir "$OUT/logs" --tensorboard-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 1000 \
    --exit-signal-handler --exit-signal SIGUSR1

# Stopped early by the signal (the checkpoint is behind --train-iters): run again.
DONE="$(cat "$OUT/checkpoints/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)"
if [ "$DONE" -lt "$TRAIN_ITERS" ]; then
    echo "stopped at iteration $DONE of $TRAIN_ITERS: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
fi
