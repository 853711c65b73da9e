#!/usr/bin/env bash
# The README's main job: a tiny GPT learns the Python standard library's own source
# (no download), TP=2 x DP=2 with ZeRO-Offload, on CPU with gloo — or on the GPUs.
# It leaves a checkpoint (a re-run resumes from it), prints a greedy sample at every
# evaluation and at the end, writes the loss curve and ends with the next commands.
#
# Environment (all optional): MODEL (gpt, or llama: RMSNorm, SwiGLU, rotary positions,
# 2 K/V groups, untied output layer, no linear biases; 4.46M parameters against GPT's
# 4.27M), RUN_DIR (runs/tiny_cpu, or runs/tiny_cpu_llama: log.jsonl, loss.png, ckpt/),
# SAVE_DIR (RUN_DIR/ckpt), LOG_JSON (RUN_DIR/log.jsonl), TRAIN_ITERS (250), NPROC, TP,
# SAMPLE_PROMPT ("def parse("), DATA_PATH (a preprocessed prefix; default the embedded
# corpus), TOKENIZER_MODEL, SKIP_SETUP=1 (use this Python as it is: no pip install),
# DRY_RUN=1 (print the plan and the command only). Extra arguments go to
# pretrain_gpt.py after this script's own, so they override them (argparse keeps the
# last value): e.g. `bash scripts/pretrain_gpt_tiny_cpu.sh --num-layers 6`.
set -euo pipefail
cd "$(dirname "$0")/.."
# q WORD: WORD as the shell reads it back ('...' quoting only where needed).
q() { if [[ "$1" =~ ^[A-Za-z0-9_./:=+-]+$ ]]; then printf '%s' "$1"; else printf "'%s'" "${1//\'/\'\\\'\'}"; fi; }
# What the user set, so the resume command printed at the end is the same command.
GIVEN=()
for var in MODEL RUN_DIR SAVE_DIR LOG_JSON TRAIN_ITERS NPROC TP SAMPLE_PROMPT DATA_PATH \
           TOKENIZER_MODEL SKIP_SETUP PYTHON; do
  [ -n "${!var+set}" ] && GIVEN+=("$var=$(q "${!var}")")
done
MODEL=${MODEL:-gpt}
case "$MODEL" in
  gpt) MODEL_ARGS=(); NAME="tiny GPT"; HF="GPT2LMHeadModel"; RUN_DIR=${RUN_DIR:-runs/tiny_cpu} ;;
  # The GPT's 4 layers x 256; SwiGLU's three matrices at 2h wide: +4% parameters with
  # the untied output layer, no position table.
  llama) MODEL_ARGS=(--normalization RMSNorm --swiglu --ffn-hidden-size 512
                     --position-embedding-type rope --group-query-attention
                     --num-query-groups 2 --untie-embeddings-and-output-weights
                     --disable-bias-linear)
         NAME="tiny Llama"; HF="LlamaForCausalLM"; RUN_DIR=${RUN_DIR:-runs/tiny_cpu_llama} ;;
  *) echo "pretrain_gpt_tiny_cpu.sh: error: MODEL must be gpt or llama, got '$MODEL'" >&2
     exit 2 ;;
esac
[ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup_env.sh >&2
PY=${PYTHON:-python3}
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ]; then
  NPROC=${NPROC:-$(( NGPU >= 4 ? 4 : 2 ))}; TP=${TP:-2}
elif [ "$NGPU" -eq 1 ]; then
  NPROC=${NPROC:-1}; TP=${TP:-1}
else
  # four ranks share the host's cores: each takes its share (--cpu-threads-per-rank N to
  # choose; OMP_NUM_THREADS is ignored)
  NPROC=${NPROC:-4}; TP=${TP:-2}
fi
SAVE_DIR=${SAVE_DIR:-$RUN_DIR/ckpt}
LOG_JSON=${LOG_JSON:-$RUN_DIR/log.jsonl}
SAMPLE_PROMPT=${SAMPLE_PROMPT-def parse(}
ARGS=(
  --tensor-model-parallel-size "$TP"
  --num-layers 4 --hidden-size 256 --num-attention-heads 4
  --seq-length 256 --max-position-embeddings 256 ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"}
  --micro-batch-size 4 --global-batch-size 16
  --train-iters "${TRAIN_ITERS:-250}" --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 20
  --lr-decay-style cosine --weight-decay 0.01 --clip-grad 1.0
  --hidden-dropout 0.0 --attention-dropout 0.0
  --bf16 --cpu-offload
  --eval-interval 50 --eval-iters 8 --log-interval 10
  --log-json "$LOG_JSON"
  --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 50 --keep-checkpoints 2
  --sample-prompt "$SAMPLE_PROMPT" --sample-tokens 24
)
[ -n "${DATA_PATH:-}" ] && ARGS+=(--data-path $DATA_PATH)
[ -n "${TOKENIZER_MODEL:-}" ] && ARGS+=(--tokenizer-model "$TOKENIZER_MODEL")
CMD=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py "${ARGS[@]}" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  "$PY" pretrain_gpt.py "${ARGS[@]}" "$@" --dry-run --world-size "$NPROC"
  LINE=""
  for w in "${CMD[@]}"; do LINE+="$(q "$w") "; done  # quoted: the line runs as printed
  echo "${LINE% }"
  exit 0
fi
mkdir -p "$RUN_DIR" "$(dirname "$LOG_JSON")"
START=$SECONDS
# Ctrl-C (or SIGTERM): every rank finishes its step and saves; re-running resumes there.
set +e
"$PY" scripts/torchrun_quiet.py "${CMD[@]:3}"  # torchrun, without its failure report
RC=$?
set -e
if [ "$RC" -ne 0 ]; then
  # Resuming is advice only where a checkpoint exists (the latest pointer is written last);
  # exit 2 is a configuration or input error: nothing ran.
  SAVED=""
  [ -f "$SAVE_DIR/latest_checkpointed_iteration.txt" ] && SAVED=yes
  if [ "$RC" -eq 2 ]; then
    NEXT="correct what the error above names, then run it again"
    [ -n "$SAVED" ] && NEXT+=" (it resumes from the latest checkpoint in $SAVE_DIR)"
  elif [ -n "$SAVED" ]; then
    NEXT="run the same command again to resume from the latest checkpoint in $SAVE_DIR"
  else
    NEXT="no checkpoint was saved in $SAVE_DIR: running it again starts from scratch"
  fi
  echo "pretrain_gpt_tiny_cpu.sh: training stopped (exit $RC) after $((SECONDS - START)) s; $NEXT" >&2
  exit "$RC"
fi

echo
if "$PY" -c "import matplotlib" 2>/dev/null; then
  "$PY" tools/plot_loss.py --log-json "$LOG_JSON" --out "$RUN_DIR/loss.png" --labels "$NAME" \
    --title "$NAME on the Python standard library" >/dev/null
  echo "loss curve: $RUN_DIR/loss.png"
else
  echo "loss curve: not drawn (matplotlib is not installed: pip install matplotlib)"
fi
RERUN=""
for kv in "${GIVEN[@]}"; do [[ "$kv" == TRAIN_ITERS=* ]] || RERUN+="$kv "; done
RERUN+="bash scripts/pretrain_gpt_tiny_cpu.sh"
for a in "$@"; do RERUN+=" $(q "$a")"; done
ITERS=${TRAIN_ITERS:-250}
echo "finished in $((SECONDS - START)) s. Next:"
echo "  train on to $((2 * ITERS)) iterations (resumes from the checkpoint; the same command"
echo "  without TRAIN_ITERS=$((2 * ITERS)) resumes an interrupted run):"
echo "    TRAIN_ITERS=$((2 * ITERS)) $RERUN"
echo "  generate from the checkpoint:"
echo "    $PY tools/generate.py --load $(q "$SAVE_DIR") --prompt $(q "${SAMPLE_PROMPT:-def }")" \
     "--max-new-tokens 64 --top-p 0.9"
echo "  export to Hugging Face ($HF):"
echo "    $PY tools/convert_checkpoint.py --load $(q "$SAVE_DIR") --hf-out $(q "$RUN_DIR/hf")"
