#!/usr/bin/env bash
# A Mixtral-style MoE GPT (16 layers, hidden 1024, 8 SwiGLU experts of 2816, top-2) on the
# GPUs of one node, bf16, MFSDP ZeRO-3 with expert parallelism: EP (default: all GPUs / TP,
# at most 8) ranks split each layer's experts; the dense weights are sharded over the
# NPROC / TP data-parallel ranks, the experts over those holding the same experts
# (NPROC / (TP x EP) of them). With TP > 1 every layer, each expert included, is split
# over TP consecutive GPUs (with sequence parallelism), and each TP rank exchanges tokens
# with the EP ranks of its own TP rank.
#
#   bash examples/train_moe_gpu.sh                          # all GPUs, EP = min(8, GPUs)
#   NPROC=8 EP=4 DATA_PATH=data/my_corpus_text_document bash examples/train_moe_gpu.sh
#   NPROC=8 TP=2 EP=2 bash examples/train_moe_gpu.sh        # TP=2 x EP=2 x expert-DP 2
set -euo pipefail
cd "$(dirname "$0")/.."
MEGATRON_EXTRAS=logging source scripts/setup_env.sh

NPROC="${NPROC:-$(python -c 'import torch; print(max(1, torch.cuda.device_count()))')}"
TP="${TP:-1}"
EP="${EP:-$(( NPROC / TP < 8 ? NPROC / TP : 8 ))}"
TP_ARGS=(--tensor-model-parallel-size "$TP")
[ "$TP" -eq 1 ] || TP_ARGS+=(--sequence-parallel)
OUT="${OUT:-runs/moe_gpu}"
TRAIN_ITERS="${TRAIN_ITERS:-5000}"
MICRO_BATCH="${MICRO_BATCH:-8}"
GLOBAL_BATCH="${GLOBAL_BATCH:-$((MICRO_BATCH * NPROC * 2))}"
DATA_ARGS=(--split 95,5,0)
if [ -n "${DATA_PATH:-}" ]; then
    # shellcheck disable=SC2206
    DATA_ARGS=(--data-path $DATA_PATH --split 969,30,1)
fi

python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
    --num-layers 16 --hidden-size 1024 --num-attention-heads 16 --num-query-groups 4 --seq-length 2048 \
    --max-position-embeddings 2048 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
    --untie-embeddings-and-output-weights \
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 2816 --expert-model-parallel-size "$EP" "${TP_ARGS[@]}" \
    --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 --moe-router-dtype fp32 --moe-grouped-gemm \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" \
    --optimizer adam --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 200 \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
    --train-iters "$TRAIN_ITERS" --log-interval 10 --eval-interval 500 --eval-iters 20 \
    --tokenizer-type GPT2BPETokenizer "${DATA_ARGS[@]}" --num-workers 2 \
    --bf16 --use-mfsdp --data-parallel-sharding-strategy optim_grads_params \
    --distributed-backend nccl \
    --log-throughput --log-dir "$OUT/logs" --tensorboard-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 1000 \
    "$@"
