#!/usr/bin/env bash
# GPT 10B (50 layers, hidden 4096, 32 heads, seq 1024) with data-parallel ZeRO-Offload
# over up to 128 GPUs (the paper's scaling run: >30 TFLOPS/GPU, near-linear, 1-128).
# TP=1 by default: each rank offloads and updates 1/world of the optimizer state, so
# per-rank host memory and CPU Adam time shrink as nodes are added (see
# `python -m mp_offload.plan --throughput`).
#
# Run this script on every node (e.g. from `srun` or a job array). Rendezvous is static:
#   NNODES (SLURM_NNODES, else 1), NODE_RANK (SLURM_NODEID, else 0),
#   MASTER_ADDR (required with NNODES > 1: the first node's address),
#   MASTER_PORT (29500), GPUS_PER_NODE (this machine's GPU count; 16 on a dry run).
# Also: DATA_PATH (data/gpt_text_document), TOKENIZER_MODEL (data/tokenizer.model),
# SAVE_DIR (checkpoints/gpt_10b_multinode; must be shared storage), TP (1), PRECISION
# (bf16), MICRO_BATCH (4), BATCH_PER_GPU (16: global batch = BATCH_PER_GPU x DP),
# TRAIN_ITERS (100000), DPU_WARMUP (unset: off), MOCK_DATA, DRY_RUN, PLAN_*.
source "$(dirname "$0")/common.sh"
DATA_PATH=${DATA_PATH-$ROOT/data/gpt_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL-$ROOT/data/tokenizer.model}
SAVE_DIR=${SAVE_DIR:-$ROOT/checkpoints/gpt_10b_multinode}
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
MASTER_PORT=${MASTER_PORT:-29500}
if [ -z "${GPUS_PER_NODE:-}" ]; then
  GPUS_PER_NODE=$(gpus_here)
  if [ "$GPUS_PER_NODE" -eq 0 ] && is_dry; then GPUS_PER_NODE=16; fi
fi
TP=${TP:-1}
PRECISION=${PRECISION:-bf16}
check_precision
require_int NNODES 1
require_int NODE_RANK 0
require_int MASTER_PORT 1
require_int TP 1
[ "$NODE_RANK" -lt "$NNODES" ] || die "NODE_RANK=$NODE_RANK must be < NNODES=$NNODES"
if [ "$NNODES" -gt 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
  die "MASTER_ADDR is empty (the address of node 0; needed with NNODES=$NNODES)"
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
check_gpus GPUS_PER_NODE
WORLD=$((NNODES * GPUS_PER_NODE))
[ $((WORLD % TP)) -eq 0 ] || die "TP=$TP does not divide NNODES x GPUS_PER_NODE = $WORLD"
[ "$WORLD" -le 128 ] || echo "$SCRIPT: note: $WORLD GPUs is past the 128 this was sized for" >&2
BATCH_PER_GPU=${BATCH_PER_GPU:-16}
require_int BATCH_PER_GPU 1
check_save_dir
data_args
plan_target 32 1536
dpu_args
ARGS=(
  --tensor-model-parallel-size "$TP"
  --num-layers 50 --hidden-size 4096 --num-attention-heads 32
  --seq-length 1024 --max-position-embeddings 1024 --vocab-size 50257
  --micro-batch-size "${MICRO_BATCH:-4}" --global-batch-size $((BATCH_PER_GPU * WORLD / TP))
  --train-iters "${TRAIN_ITERS:-100000}" --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 2000
  --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
  "--$PRECISION" --cpu-offload --recompute-activations "${DPU_ARGS[@]}"
  "${DATA_ARGS[@]}"
  --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 500 --log-json "$SAVE_DIR/log.jsonl"
  --log-interval 1 --eval-interval 1000 --eval-iters 10
)
launch "$NNODES" "$GPUS_PER_NODE" "${ARGS[@]}" "$@"
