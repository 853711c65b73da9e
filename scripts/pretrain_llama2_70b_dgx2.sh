#!/usr/bin/env bash
# Llama 2 70B (80 layers, hidden 8192, SwiGLU FFN 28672, 64 heads in 8 K/V groups,
# vocabulary 32000, RoPE, RMSNorm, untied head, no linear biases, seq 4096: 68.99B
# parameters) on ONE DGX-2 (16x V100-32GB, 1.5 TB host): TP=8 x DP=2 with
# --sequence-parallel and ZeRO-Offload over the 2 DP ranks of each TP shard.
#
# Why this layout (the plan, DRY_RUN=1):
# - TP=8 is the most there can be: the 8 K/V groups are split over the TP ranks,
#   never replicated, so --num-query-groups 8 refuses TP=16. 64 heads, 8192 and 28672
#   all split by 8, and TP stays inside the node (NVSwitch).
# - device: fp16 params 16.1 GiB per GPU + activations. --sequence-parallel keeps the
#   layers' checkpointed inputs, norms and dropout as 1/8 sequence shards: ~1.7 GiB of
#   activations at micro-batch 2 instead of ~11.4 GiB without it; ~19 GiB of 32 in all.
# - host: 20 B/param over all 16 ranks = ~1.29 TiB of 1.5 (the limit, as for the GPT 70B).
# - V100s have no bf16: fp16 with dynamic loss scaling.
#
# Environment (defaults): DATA_PATH (data/llama2_text_document), TOKENIZER_MODEL
# (data/llama2_tokenizer.model, SentencePiece), SAVE_DIR (checkpoints/llama2_70b), NGPUS
# (16), TP (8), PRECISION (fp16 on V100; bf16 on newer GPUs), MICRO_BATCH (2),
# GLOBAL_BATCH (64), TRAIN_ITERS (100000), DPU_WARMUP (unset: off), MOCK_DATA, DRY_RUN,
# PLAN_*. Extra arguments go to pretrain_gpt.py (last one wins).
source "$(dirname "$0")/common.sh"
DATA_PATH=${DATA_PATH-$ROOT/data/llama2_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL-$ROOT/data/llama2_tokenizer.model}
SAVE_DIR=${SAVE_DIR:-$ROOT/checkpoints/llama2_70b}
NGPUS=${NGPUS:-16}
TP=${TP:-8}
PRECISION=${PRECISION:-fp16}
check_precision
check_gpus NGPUS
require_int TP 1
[ $((NGPUS % TP)) -eq 0 ] || die "TP=$TP does not divide NGPUS=$NGPUS"
[ $((8 % TP)) -eq 0 ] || die "TP=$TP: the 8 key/value groups must split evenly (TP 1, 2, 4 or 8)"
check_save_dir
data_args
plan_target 32 1536
dpu_args
ARGS=(
  --tensor-model-parallel-size "$TP" --sequence-parallel
  --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64
  --group-query-attention --num-query-groups 8 --vocab-size 32000
  --normalization RMSNorm --layernorm-epsilon 1e-5 --swiglu
  --position-embedding-type rope --rotary-base 10000
  --untie-embeddings-and-output-weights --disable-bias-linear
  --hidden-dropout 0 --attention-dropout 0
  --seq-length 4096 --max-position-embeddings 4096
  --micro-batch-size "${MICRO_BATCH:-2}" --global-batch-size "${GLOBAL_BATCH:-64}"
  --train-iters "${TRAIN_ITERS:-100000}" --lr 1.5e-4 --min-lr 1.5e-5 --lr-warmup-iters 2000
  --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
  --adam-eps 1e-5 "--$PRECISION" --cpu-offload --recompute-activations "${DPU_ARGS[@]}"
  "${DATA_ARGS[@]}"
  --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 200 --log-json "$SAVE_DIR/log.jsonl"
  --log-interval 1 --eval-interval 1000 --eval-iters 5
)
launch 1 "$NGPUS" "${ARGS[@]}" "$@"
