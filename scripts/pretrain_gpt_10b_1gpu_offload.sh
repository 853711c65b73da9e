#!/usr/bin/env bash
# GPT 10B (the paper's / DeepSpeed's example: 50 layers, hidden 4096, 32 heads,
# seq 1024) on ONE GPU with ZeRO-Offload: 2 B/param on the device (~19 GiB of bf16
# params + one 0.4 GiB gradient bucket + activations with recomputation), 20 B/param
# on the host (fp32 master, m, v, grad + pinned staging: ~193 GiB).
# Target: a 32 GiB V100 or larger with >= 256 GiB host memory (DRY_RUN=1 checks).
#
# Environment (defaults): DATA_PATH (data/gpt_text_document), TOKENIZER_MODEL
# (data/tokenizer.model), SAVE_DIR (checkpoints/gpt_10b), NGPUS (1), PRECISION
# (bf16; fp16 on a V100), MICRO_BATCH (4), GLOBAL_BATCH (16), TRAIN_ITERS (100000),
# DPU_WARMUP (unset: off; e.g. 40 as in the paper), MOCK_DATA, DRY_RUN, PLAN_*.
source "$(dirname "$0")/common.sh"
DATA_PATH=${DATA_PATH-$ROOT/data/gpt_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL-$ROOT/data/tokenizer.model}
SAVE_DIR=${SAVE_DIR:-$ROOT/checkpoints/gpt_10b}
NGPUS=${NGPUS:-1}
PRECISION=${PRECISION:-bf16}
check_precision
check_gpus NGPUS
check_save_dir
data_args
plan_target 32 256
dpu_args
ARGS=(
  --num-layers 50 --hidden-size 4096 --num-attention-heads 32
  --seq-length 1024 --max-position-embeddings 1024 --vocab-size 50257
  --micro-batch-size "${MICRO_BATCH:-4}" --global-batch-size "${GLOBAL_BATCH:-16}"
  --train-iters "${TRAIN_ITERS:-100000}" --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 2000
  --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
  "--$PRECISION" --cpu-offload --recompute-activations "${DPU_ARGS[@]}"
  "${DATA_ARGS[@]}"
  --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 500 --log-json "$SAVE_DIR/log.jsonl"
  --log-interval 1 --eval-interval 1000 --eval-iters 10
)
launch 1 "$NGPUS" "${ARGS[@]}" "$@"
