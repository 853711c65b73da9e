#!/usr/bin/env bash
# GPT 1.3B (GPT-3 table: 24 layers, hidden 2048, 16 heads, seq 2048) on one GPU.
# The planner says it fits an 80 GiB GPU *without* offload: ZeRO-2 at DP=1 holds
# 18 B/param (bf16 params + fp32 master, m, v, grad) = ~22 GiB, plus ~18 GiB of
# activations at micro-batch 4: ~41.5 GiB (DRY_RUN=1 prints it). OFFLOAD=1 moves
# the fp32 state to the host (then ~22 GiB on the device).
#
# Environment (defaults): DATA_PATH (data/gpt_text_document), TOKENIZER_MODEL
# (data/tokenizer.model), SAVE_DIR (checkpoints/gpt_1.3b), NGPUS (1), OFFLOAD (0),
# MICRO_BATCH (4), GLOBAL_BATCH (32), TRAIN_ITERS (100000), MOCK_DATA, DRY_RUN,
# PLAN_* (see common.sh). Extra arguments go to pretrain_gpt.py (last one wins).
source "$(dirname "$0")/common.sh"
DATA_PATH=${DATA_PATH-$ROOT/data/gpt_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL-$ROOT/data/tokenizer.model}
SAVE_DIR=${SAVE_DIR:-$ROOT/checkpoints/gpt_1.3b}
NGPUS=${NGPUS:-1}
check_gpus NGPUS
check_save_dir
data_args
plan_target 80 256
OFFLOAD_ARGS=()
[ "${OFFLOAD:-0}" = 1 ] && OFFLOAD_ARGS=(--cpu-offload)
ARGS=(
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16
  --seq-length 2048 --max-position-embeddings 2048 --vocab-size 50257
  --micro-batch-size "${MICRO_BATCH:-4}" --global-batch-size "${GLOBAL_BATCH:-32}"
  --train-iters "${TRAIN_ITERS:-100000}" --lr 2e-4 --min-lr 2e-5 --lr-warmup-iters 2000
  --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
  --bf16 "${OFFLOAD_ARGS[@]}"
  "${DATA_ARGS[@]}"
  --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 1000 --log-json "$SAVE_DIR/log.jsonl"
  --log-interval 10 --eval-interval 1000 --eval-iters 10
)
launch 1 "$NGPUS" "${ARGS[@]}" "$@"
