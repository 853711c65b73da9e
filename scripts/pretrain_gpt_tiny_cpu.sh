#!/usr/bin/env bash
# The README's main job: a tiny GPT learns the Python standard library's own source
# (no download), TP=2 x DP=2 with ZeRO-Offload, on CPU with gloo — or on the GPUs.
#
# Environment (all optional): DATA_PATH (a preprocessed prefix; default the embedded
# corpus), TOKENIZER_MODEL, SAVE_DIR, NPROC, TP, TRAIN_ITERS, DRY_RUN=1 (print the
# plan and the command only). Extra arguments go to pretrain_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh >&2
PY=${PYTHON:-python3}
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ]; then
  NPROC=${NPROC:-$(( NGPU >= 4 ? 4 : 2 ))}; TP=${TP:-2}
elif [ "$NGPU" -eq 1 ]; then
  NPROC=${NPROC:-1}; TP=${TP:-1}
else
  NPROC=${NPROC:-4}; TP=${TP:-2}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # four ranks share the host's cores
fi
ARGS=(
  --tensor-model-parallel-size "$TP"
  --num-layers 4 --hidden-size 256 --num-attention-heads 4
  --seq-length 256 --max-position-embeddings 256
  --micro-batch-size 4 --global-batch-size 16
  --train-iters "${TRAIN_ITERS:-250}" --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 20
  --lr-decay-style cosine --weight-decay 0.01 --clip-grad 1.0
  --hidden-dropout 0.0 --attention-dropout 0.0
  --bf16 --cpu-offload
  --eval-interval 50 --eval-iters 8 --log-interval 10
  --log-json "${LOG_JSON:-runs/tiny_cpu/log.jsonl}"
)
[ -n "${DATA_PATH:-}" ] && ARGS+=(--data-path $DATA_PATH)
[ -n "${TOKENIZER_MODEL:-}" ] && ARGS+=(--tokenizer-model "$TOKENIZER_MODEL")
mkdir -p "$(dirname "${LOG_JSON:-runs/tiny_cpu/log.jsonl}")"
CMD=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py "${ARGS[@]}" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  "$PY" pretrain_gpt.py "${ARGS[@]}" "$@" --dry-run --world-size "$NPROC" || true
  echo "${CMD[*]}"
  exit 0
fi
exec "${CMD[@]}"
