# Shared by the launch scripts (source it; it defines functions and reads the environment).
#
# Environment read here (each script documents its defaults):
#   DATA_PATH        preprocessed prefix, or "weight prefix weight prefix ..." (blend)
#   TOKENIZER_MODEL  SentencePiece model file (HuggingFaceTokenizer scripts: a
#                    tokenizer.json or a directory holding one)
#   SAVE_DIR         checkpoints and logs
#   MOCK_DATA=1      train on synthetic tokens (no DATA_PATH / TOKENIZER_MODEL needed)
#   DRY_RUN=1        print the memory plan for every rank kind and the exact torchrun
#                    command, then exit without training (problems become warnings)
#   PLAN_DEVICE_MEMORY_GB, PLAN_HOST_MEMORY_GB, PLAN_DEVICES_PER_NODE
#                    hardware the dry run plans for (default: this machine if it has
#                    CUDA, else each script's target)
#   PLAN_HOST_HEADROOM_GB  host memory per node a plan leaves free (default 10%)
#   PLAN_DEVICE_MEMORY_RESERVE_GB  device memory a plan leaves free (default: the
#                    larger of 5% and 2 GiB)
#   PYTHON           interpreter (default python3)
#
# Host threads: each rank's CPU Adam, host gradient sums and torch's intra-op pool take the
# node's usable cores divided among its ranks, less one per rank on a GPU for the threads
# that launch kernels (mp_offload/runtime/cpu_threads.py); the start-up line says how many.
# OMP_NUM_THREADS is ignored on purpose (torchrun sets it to 1 for every multi-process job);
# append --cpu-threads-per-rank N to a script's command to choose.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=${PYTHON:-python3}
SCRIPT=$(basename "$0")

die() { echo "$SCRIPT: error: $*" >&2; exit 2; }
is_dry() { [ "${DRY_RUN:-0}" = 1 ]; }
# A problem that stops a real run; a dry run only needs the flags, so it just warns.
problem() { if is_dry; then echo "$SCRIPT: warning: $*" >&2; else die "$*"; fi; }

# require_int VAR MIN: VAR holds an integer >= MIN.
require_int() {
  local name=$1 min=$2 value=${!1:-}
  [[ "$value" =~ ^[0-9]+$ ]] || die "$name must be a whole number, got '${value}'"
  [ "$value" -ge "$min" ] || die "$name must be >= $min, got $value"
}

# check_precision: PRECISION is bf16 or fp16 (the recipes' mixed-precision choice).
check_precision() {
  [[ "${PRECISION:-}" =~ ^(bf16|fp16)$ ]] || die "PRECISION must be bf16 or fp16, got '${PRECISION:-}'"
}

# GPUs this job may use (0 without CUDA): CUDA_VISIBLE_DEVICES when it is set, else all
# of the machine's; nvidia-smi first because importing torch is slow.
gpus_here() {
  local all
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    all=$(nvidia-smi -L | grep -c '^GPU')
  else
    all=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  fi
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    local visible=0 id
    for id in ${CUDA_VISIBLE_DEVICES//,/ }; do
      [ "$id" = "-1" ] && break  # CUDA stops at the first invalid id
      visible=$((visible + 1))
    done
    [ "$visible" -lt "$all" ] && all=$visible
  fi
  echo "$all"
}

# check_gpus VAR: the per-node GPU count VAR asks for is present (real runs only).
check_gpus() {
  local name=$1
  require_int "$name" 1
  is_dry && return 0
  local have
  have=$(gpus_here)
  [ "${!name}" -le "$have" ] || die "$name=${!name} but this machine has $have CUDA GPU(s)"
}

# data_args [TOKENIZER_TYPE]: --data-path/--tokenizer-model flags into DATA_ARGS, after
# checking them. TOKENIZER_TYPE: SentencePieceTokenizer (default) or HuggingFaceTokenizer.
data_args() {
  local type=${1:-SentencePieceTokenizer}
  DATA_ARGS=()
  if [ "${MOCK_DATA:-0}" = 1 ]; then
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer)
    return 0
  fi
  [ -n "${DATA_PATH:-}" ] || problem "DATA_PATH is empty (a preprocessed prefix; or MOCK_DATA=1)"
  local item
  for item in ${DATA_PATH:-}; do  # a blend alternates weights and prefixes
    [[ "$item" =~ ^[0-9.]+$ ]] && continue
    [ -f "$item.idx" ] && [ -f "$item.bin" ] || \
      problem "DATA_PATH: no $item.idx/.bin (run tools/preprocess_data.py first)"
  done
  if [ "$type" = HuggingFaceTokenizer ]; then
    [ -e "${TOKENIZER_MODEL:-}" ] || problem "TOKENIZER_MODEL: no such file or directory" \
      "'${TOKENIZER_MODEL:-}' (a tokenizer.json or a directory holding one)"
  else
    [ -f "${TOKENIZER_MODEL:-}" ] || \
      problem "TOKENIZER_MODEL: no such file '${TOKENIZER_MODEL:-}' (a SentencePiece .model)"
  fi
  # shellcheck disable=SC2206 # the blend is deliberately split into words
  DATA_ARGS=(--data-path ${DATA_PATH:-missing} --tokenizer-type "$type"
             --tokenizer-model "${TOKENIZER_MODEL:-missing}")
}

# dpu_args: DPU_ARGS holds --dpu-warmup-steps when DPU_WARMUP is set (DPU is off by default).
dpu_args() {
  DPU_ARGS=()
  if [ -n "${DPU_WARMUP:-}" ]; then
    require_int DPU_WARMUP 0
    DPU_ARGS=(--dpu-warmup-steps "$DPU_WARMUP")
  fi
}

# check_save_dir: SAVE_DIR can be created and written (not created on a dry run).
check_save_dir() {
  [ -n "${SAVE_DIR:-}" ] || die "SAVE_DIR is empty"
  is_dry && return 0
  mkdir -p "$SAVE_DIR" 2>/dev/null && [ -w "$SAVE_DIR" ] || \
    die "SAVE_DIR '$SAVE_DIR' is not writable"
}

# plan_target DEVICE_GB HOST_GB: the hardware a script is written for. A dry run on a
# machine without CUDA plans for it unless PLAN_* say otherwise (with CUDA: this machine).
plan_target() {
  is_dry || return 0
  [ "$(gpus_here)" -gt 0 ] && return 0
  export PLAN_DEVICE_MEMORY_GB=${PLAN_DEVICE_MEMORY_GB:-$1}
  export PLAN_HOST_MEMORY_GB=${PLAN_HOST_MEMORY_GB:-$2}
}

# launch NNODES NPROC_PER_NODE PRETRAIN_ARGS...: torchrun pretrain_gpt.py, or the dry run.
# More than one node uses a static rendezvous from NODE_RANK, MASTER_ADDR, MASTER_PORT.
launch() {
  local nnodes=$1 nproc=$2
  shift 2
  local world=$((nnodes * nproc))
  local -a rdzv=(--standalone)
  if [ "$nnodes" -gt 1 ]; then
    rdzv=(--nnodes "$nnodes" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR"
          --master-port "$MASTER_PORT")
  fi
  local -a cmd=("$PY" -m torch.distributed.run "${rdzv[@]}" --nproc-per-node "$nproc"
                pretrain_gpt.py "$@")
  cd "$ROOT"
  if is_dry; then
    echo "== memory plan ($world ranks, $nnodes node(s) x $nproc) =="
    PLAN_DEVICES_PER_NODE=${PLAN_DEVICES_PER_NODE:-$nproc} \
      "$PY" pretrain_gpt.py "$@" --dry-run --world-size "$world"
    if [ "$nnodes" -gt 1 ]; then
      echo "== command (run on every node, each with its own NODE_RANK) =="
    else
      echo "== command =="
    fi
    printf '%q ' "${cmd[@]}"
    echo
    return 0
  fi
  if [ "$nnodes" -gt 1 ] && [ "$NODE_RANK" = 0 ]; then
    check_port "$MASTER_PORT"
  fi
  echo "$SCRIPT: ${cmd[*]}" >&2
  # torchrun without its own failure report: the project's line stays the last one; a
  # Ctrl-C (every rank saves and stops) exits 130, as README says
  exec "$PY" "$ROOT/scripts/torchrun_quiet.py" "${cmd[@]:3}"
}

# check_port PORT: nothing on this host listens on PORT yet (the rendezvous host binds it;
# torchrun's own answer to a taken port is an EADDRINUSE traceback).
check_port() {
  [[ "$1" =~ ^[0-9]+$ ]] && [ "$1" -ge 1 ] && [ "$1" -le 65535 ] || \
    die "MASTER_PORT must be a port number (1-65535), got '$1'"
  "$PY" -c "import socket, sys; socket.create_server(('', int(sys.argv[1]))).close()" "$1" \
    2>/dev/null || die "MASTER_PORT $1 is in use on this host (another job?): choose another"
}
