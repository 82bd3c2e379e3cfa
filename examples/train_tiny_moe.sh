#!/usr/bin/env bash
# A small mixture-of-experts GPT (Mixtral style: RoPE, RMSNorm, 8 SwiGLU experts, top-2) on
# 4 CPU ranks with expert parallelism 2 (each rank holds 4 of each layer's 8 experts, and
# exchanges tokens with its EP partner by all-to-all), MFSDP ZeRO-3: dense weights sharded
# over the 4 ranks, experts over the 2 ranks that hold the same experts. Then a sample from
# the final checkpoint (generate.py builds it in one process with all 8 experts).
#
#   bash examples/train_tiny_moe.sh
#   TRAIN_ITERS=50 OUT=runs/moe_short bash examples/train_tiny_moe.sh
#   SKIP_SETUP=1 bash examples/train_tiny_moe.sh        # the environment is installed already
#   TP=2 bash examples/train_tiny_moe.sh                # TP=2 x EP=2: every expert split over a TP pair too
#   INSTANCES=2 bash examples/train_tiny_moe.sh         # HSDP: 2 instances of 2 ranks (EP=2 inside each);
#                                                       # experts over the mesh (expert_outer 2, expert_inner 1)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${SKIP_SETUP:-}" ] || source scripts/setup_env.sh

OUT="${OUT:-runs/tiny_moe}"
TRAIN_ITERS="${TRAIN_ITERS:-200}"
VOCAB="${VOCAB:-4096}"
NPROC="${NPROC:-4}"
EP="${EP:-2}"
TP="${TP:-1}"
INSTANCES="${INSTANCES:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export WANDB_MODE="${WANDB_MODE:-offline}"
rm -rf "$OUT"

python tools/prepare_shakespeare.py --vocab-size "$VOCAB" >/dev/null
tokenizer="data/cache/shakespeare_bpe$VOCAB"

python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --max-position-embeddings 128 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
    --untie-embeddings-and-output-weights \
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256 --expert-model-parallel-size "$EP" \
    --tensor-model-parallel-size "$TP" \
    --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 --moe-grouped-gemm \
    --micro-batch-size 4 --global-batch-size 16 \
    --optimizer adam --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 20 \
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
    --train-iters "$TRAIN_ITERS" --log-interval 10 --eval-interval 100 --eval-iters 4 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$tokenizer" \
    --data-path "${tokenizer}_text_document" --split 95,5,0 --num-workers 0 \
    --use-mfsdp --data-parallel-sharding-strategy optim_grads_params \
    --num-distributed-optimizer-instances "$INSTANCES" \
    --log-dir "$OUT/logs" --save "$OUT/checkpoints"

python tools/generate.py --load "$OUT/checkpoints" --prompt "ROMEO:" --max-new-tokens 80 --top-k 20 --temperature 0.8 --seed 1234
