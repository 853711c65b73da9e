#!/usr/bin/env bash
# Llama 3 8B (32 layers, hidden 4096, SwiGLU FFN 14336, 32 heads in 8 K/V groups,
# vocabulary 128256, RoPE base 500000, RMSNorm, untied head, no linear biases: 8.03B
# parameters) on ONE GPU with ZeRO-Offload, at Llama 3's own sequence length, 8192.
#
# Why 8192 fits (the plan, DRY_RUN=1; an 80 GB GPU and a 256 GiB host):
# - device: bf16 params 15.0 GiB + gradient buckets 2.0 GiB (one bucket holds the
#   525M-element embedding) + activations ~11.9 GiB at micro-batch 1 with
#   recomputation = ~29.8 GiB. Most of the activations is the 128K-vocabulary loss at
#   8192 tokens (bf16 logits and two fp32 copies, ~9.8 GiB), not the 32 layers' kept
#   inputs (2 GiB). Micro-batch 2 needs ~41.7 GiB, 4 ~65.6 GiB.
# - host: 20 B/param (fp32 master, m, v, grad; bf16 staging both ways) = ~150 GiB, so
#   the host needs ~160 GiB free: a 128 GiB host does not hold an 8B with offload.
# - on a 32 GB GPU use SEQ_LENGTH=2048 (~20.9 GiB): 8192 would leave no room for the
#   CUDA context and fragmentation.
# Llama 3's tokenizer is a Hugging Face tokenizer.json (HuggingFaceTokenizer).
#
# Environment (defaults): DATA_PATH (data/llama3_text_document), TOKENIZER_MODEL
# (data/llama3: a tokenizer.json or the directory holding it), SAVE_DIR
# (checkpoints/llama3_8b), NGPUS (1: more GPUs are data-parallel ranks), SEQ_LENGTH (8192),
# MICRO_BATCH (1), GLOBAL_BATCH (16), TRAIN_ITERS (100000), DPU_WARMUP (unset: off),
# MOCK_DATA, DRY_RUN, PLAN_* (see common.sh). Extra arguments go to pretrain_gpt.py.
source "$(dirname "$0")/common.sh"
DATA_PATH=${DATA_PATH-$ROOT/data/llama3_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL-$ROOT/data/llama3}
SAVE_DIR=${SAVE_DIR:-$ROOT/checkpoints/llama3_8b}
NGPUS=${NGPUS:-1}
SEQ_LENGTH=${SEQ_LENGTH:-8192}
require_int SEQ_LENGTH 1
check_gpus NGPUS
check_save_dir
data_args HuggingFaceTokenizer
plan_target 80 256
dpu_args
ARGS=(
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --group-query-attention --num-query-groups 8 --vocab-size 128256
  --normalization RMSNorm --layernorm-epsilon 1e-5 --swiglu
  --position-embedding-type rope --rotary-base 500000
  --untie-embeddings-and-output-weights --disable-bias-linear
  --hidden-dropout 0 --attention-dropout 0
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --micro-batch-size "${MICRO_BATCH:-1}" --global-batch-size "${GLOBAL_BATCH:-16}"
  --train-iters "${TRAIN_ITERS:-100000}" --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000
  --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
  --adam-eps 1e-5 --bf16 --cpu-offload --recompute-activations "${DPU_ARGS[@]}"
  "${DATA_ARGS[@]}"
  --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 500 --log-json "$SAVE_DIR/log.jsonl"
  --log-interval 1 --eval-interval 1000 --eval-iters 10
)
launch 1 "$NGPUS" "${ARGS[@]}" "$@"
