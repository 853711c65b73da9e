#!/usr/bin/env bash
# GPT 13B (GPT-3 table: 40 layers, hidden 5120, 40 heads, seq 1024) on ONE GPU with
# ZeRO-Offload: the paper's headline (13B on one 32 GB V100). Device ~27.6 GiB at
# micro-batch 2 with recomputation; host ~241 GiB (20 B/param), so the host needs
# >= 256 GiB. Micro-batch 4 would need ~29.8 GiB: too close to 32 on a V100.
#
# Environment (defaults): DATA_PATH (data/gpt_text_document), TOKENIZER_MODEL
# (data/tokenizer.model), SAVE_DIR (checkpoints/gpt_13b), NGPUS (1), PRECISION
# (bf16; fp16 on a V100), MICRO_BATCH (2), GLOBAL_BATCH (16), TRAIN_ITERS (100000),
# DPU_WARMUP (unset: off), MOCK_DATA, DRY_RUN, PLAN_*.
source "$(dirname "$0")/common.sh"
DATA_PATH=${DATA_PATH-$ROOT/data/gpt_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL-$ROOT/data/tokenizer.model}
SAVE_DIR=${SAVE_DIR:-$ROOT/checkpoints/gpt_13b}
NGPUS=${NGPUS:-1}
PRECISION=${PRECISION:-bf16}
check_precision
check_gpus NGPUS
check_save_dir
data_args
plan_target 32 384
dpu_args
ARGS=(
  --num-layers 40 --hidden-size 5120 --num-attention-heads 40
  --seq-length 1024 --max-position-embeddings 1024 --vocab-size 50257
  --micro-batch-size "${MICRO_BATCH:-2}" --global-batch-size "${GLOBAL_BATCH:-16}"
  --train-iters "${TRAIN_ITERS:-100000}" --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 2000
  --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
  "--$PRECISION" --cpu-offload --recompute-activations "${DPU_ARGS[@]}"
  "${DATA_ARGS[@]}"
  --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 500 --log-json "$SAVE_DIR/log.jsonl"
  --log-interval 1 --eval-interval 1000 --eval-iters 10
)
launch 1 "$NGPUS" "${ARGS[@]}" "$@"
