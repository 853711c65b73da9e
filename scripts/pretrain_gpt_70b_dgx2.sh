#!/usr/bin/env bash
# GPT ~70B (86 layers, hidden 8192, 64 heads, seq 1024: 69.7B parameters) on ONE
# DGX-2 (16x V100-32GB, 1.5 TB host): the paper's "70B with model parallelism +
# ZeRO-Offload on one DGX-2" (model parallelism alone: under 15B).
#
# Why TP=8 x DP=2 (ZeRO-Offload over the 2 DP ranks of each TP shard):
# - TP stays inside the node (NVSwitch); 64 heads and 8192 split evenly by 8 (and 16).
# - memory per the plan: 2*69.7B/8 = 16.2 GiB of bf16 params per GPU + activations:
#   ~23.6 GiB of 32; TP=16 would need ~15.3 GiB but make every GEMM half as wide (1/16 of
#   8192 = 512 columns), which V100 tensor cores run less efficiently, and doubles
#   the TP all-reduces' share of the step.
# - the host is the limit either way: 20 B/param over all 16 ranks = ~1.3 TiB of 1.5.
#   (The CPU Adam work per rank is Ψ/16 for any TP x DP split.)
#
# Environment (defaults): DATA_PATH (data/gpt_text_document), TOKENIZER_MODEL
# (data/tokenizer.model), SAVE_DIR (checkpoints/gpt_70b), NGPUS (16), TP (8),
# PRECISION (fp16 on V100; bf16 on newer GPUs), MICRO_BATCH (4), GLOBAL_BATCH (64),
# TRAIN_ITERS (100000), DPU_WARMUP (unset: off), MOCK_DATA, DRY_RUN, PLAN_*.
# Host threads per rank (CPU Adam, host sums): the node's cores / 16, less one for the
# launching threads; OMP_NUM_THREADS is ignored: append --cpu-threads-per-rank N to change it.
source "$(dirname "$0")/common.sh"
DATA_PATH=${DATA_PATH-$ROOT/data/gpt_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL-$ROOT/data/tokenizer.model}
SAVE_DIR=${SAVE_DIR:-$ROOT/checkpoints/gpt_70b}
NGPUS=${NGPUS:-16}
TP=${TP:-8}
PRECISION=${PRECISION:-fp16}
check_precision
check_gpus NGPUS
require_int TP 1
[ $((NGPUS % TP)) -eq 0 ] || die "TP=$TP does not divide NGPUS=$NGPUS"
check_save_dir
data_args
plan_target 32 1536
dpu_args
ARGS=(
  --tensor-model-parallel-size "$TP"
  --num-layers 86 --hidden-size 8192 --num-attention-heads 64
  --seq-length 1024 --max-position-embeddings 1024 --vocab-size 50257
  --micro-batch-size "${MICRO_BATCH:-4}" --global-batch-size "${GLOBAL_BATCH:-64}"
  --train-iters "${TRAIN_ITERS:-100000}" --lr 6e-5 --min-lr 6e-6 --lr-warmup-iters 2000
  --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
  "--$PRECISION" --cpu-offload --recompute-activations "${DPU_ARGS[@]}"
  "${DATA_ARGS[@]}"
  --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 200 --log-json "$SAVE_DIR/log.jsonl"
  --log-interval 1 --eval-interval 1000 --eval-iters 5
)
launch 1 "$NGPUS" "${ARGS[@]}" "$@"
