#!/usr/bin/env bash
# GPT-2 124M-class model with MFSDP (ZeRO-3) on the GPUs of one node, bf16.
#
#   bash examples/train_gpt2_124m_gpu.sh                       # all GPUs of this node
#   NPROC=4 DATA_PATH=data/my_corpus_text_document bash examples/train_gpt2_124m_gpu.sh
#
# Without DATA_PATH it trains on the Shakespeare corpus (tools/prepare_shakespeare.py);
# for real pretraining pass a prefix written by tools/preprocess_data.py (or weighted
# prefixes: DATA_PATH="0.7 data/a_text_document 0.3 data/b_text_document").
set -euo pipefail
cd "$(dirname "$0")/.."
MEGATRON_EXTRAS=logging source scripts/setup_env.sh   # TensorBoard and W&B on top

NPROC="${NPROC:-$(python -c 'import torch; print(max(1, torch.cuda.device_count()))')}"
OUT="${OUT:-runs/gpt2_124m}"
TRAIN_ITERS="${TRAIN_ITERS:-5000}"
MICRO_BATCH="${MICRO_BATCH:-16}"
GLOBAL_BATCH="${GLOBAL_BATCH:-$((MICRO_BATCH * NPROC * 2))}"   # 2 microbatches per rank per step
DATA_ARGS=()
if [ -n "${DATA_PATH:-}" ]; then
    # shellcheck disable=SC2206
    DATA_ARGS=(--data-path $DATA_PATH --split 969,30,1)
else
    DATA_ARGS=(--split 95,5,0)
fi

python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
    --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \
    --max-position-embeddings 1024 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" \
    --optimizer adam --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 200 \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
    --train-iters "$TRAIN_ITERS" --log-interval 10 --eval-interval 500 --eval-iters 20 \
    --tokenizer-type GPT2BPETokenizer "${DATA_ARGS[@]}" --num-workers 2 \
    --bf16 --use-mfsdp --data-parallel-sharding-strategy optim_grads_params \
    --distributed-backend nccl \
    --log-throughput --log-dir "$OUT/logs" --tensorboard-dir "$OUT/tensorboard" \
    ${WANDB_PROJECT:+--wandb-project "$WANDB_PROJECT" --wandb-exp-name gpt2-124m --wandb-save-dir "$OUT"} \
    --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 1000 \
    "$@"

python tools/generate.py --load "$OUT/checkpoints" --prompt "ROMEO:" --max-new-tokens 100 --top-k 40 --temperature 0.8 --seed 1234
