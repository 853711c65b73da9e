#!/usr/bin/env bash
# The device proof: what only a GPU can settle, in one process, in order of value, under one
# global deadline (at most 5 minutes on one H200 when the C++ extensions are carried):
#   1. calibration   the machine; pinned D2H/H2D GB/s, device and host DRAM GB/s, the CPU
#                    Adam's rate, bf16 GEMM TFLOPS (<= the dense peak: the one speed gate),
#                    SDPA determinism; calib.json for the throughput model
#   2. equivalences  from one initial model, deterministic algorithms on: a model moved to
#                    the GPU and cast to bf16 before the optimizer; offload vs ZeRO-2; the
#                    overlapped CPU Adam; device vs host accumulation; remainders; F=0.5 vs
#                    F=1 (bitwise where the arithmetic is the same); DPU "delayed" (after
#                    step t its parameters are a synchronous reference's after t-1); the
#                    host Adam never rewrites a staging before its uploads' wait, and a
#                    deliberately broken optimizer (the wait removed) is caught; a forward
#                    without its per-bucket upload waits (a figure: its losses differ)
#   3. speed         figures beside the throughput model: step time of each mode, PCIe GB/s
#                    each way and bytes per parameter from the copies themselves, CPU Adam
#                    GB/s, the share of host time the overlap hides, the D2H overlap share
#   4. smoke         one torchrun pretrain_gpt.py run (offload + overlap, 4 iterations)
# The logic lives in device_proof/ (beside bench/; the library never imports it).
#
# Build: the carried extensions (mp_offload/_cpu_adam*.so, _host_ops*.so for this Python)
# are imported first; only when that fails is `setup.py build_ext --inplace --parallel`
# run, with BUILD_TIMEOUT_S (default 240) of its own. Nothing is installed.
#
# --cpu-rehearsal: the same checks, order and lines at tiny sizes with the CPU as the
# device (about two minutes on a 2-core machine).
#
# OUT (default a temporary directory) holds at most 5 files: summary.txt (one line per
# check, appended and fsynced as it finishes: PASS|FAIL|FIG|SKIP, name, value, expected,
# seconds, tab-separated), proof.log, calib.json, work.tar.gz (the smoke run's logs),
# build.log (only after a build). A run stopped early keeps every line that finished.
# Exit: 0 every check passed; 1 a check failed; 3 none failed but the deadline skipped
# some; 2 no GPU (without --cpu-rehearsal) or a bad argument.
# Environment: OUT, PYTHON, DEADLINE_S (the proof's own deadline; default 250), SECTIONS
# (a comma list of calib,equiv,speed,smoke: a rerun of what the deadline skipped, appended
# to the same summary.txt; speed reads the first run's calib.json).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY=${PYTHON:-python3}
REHEARSAL=()
case "${1:-}" in
  "") ;;
  --cpu-rehearsal) REHEARSAL=(--rehearsal) ;;
  *) echo "device_check: error: unknown argument '$1' (the only one is --cpu-rehearsal)" >&2; exit 2 ;;
esac
if [ ${#REHEARSAL[@]} -eq 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "device_check: error: no CUDA device visible to torch (nvidia-smi, CUDA_VISIBLE_DEVICES); --cpu-rehearsal runs the proof on the CPU" >&2
  exit 2
fi
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/proof.log"
if [ -z "${SECTIONS:-}" ]; then  # a fresh proof; a rerun of some sections appends to it
  rm -f "$OUT/summary.txt" "$OUT/calib.json" "$OUT/work.tar.gz" "$OUT/build.log"
  : >"$LOG"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout and its extensions
export PYTHONUNBUFFERED=1  # proof.log keeps every line up to a kill
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # deterministic GEMMs
DEADLINE_S=${DEADLINE_S:-250}
if [ ${#REHEARSAL[@]} -eq 1 ]; then
  # A shared 2-core machine: the C++ Adam's OpenMP team spinning after each step slows the
  # training thread beside it by up to 50x; the GPU run measures what users run.
  export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
fi
{
  echo "device_check: $(date -u +%FT%TZ) ${REHEARSAL[*]:-on the GPU}, output in $OUT"
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import platform, torch; print(f'python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}')"
} 2>&1 | tee -a "$LOG"
if "$PY" -c "import mp_offload._cpu_adam, mp_offload._host_ops" 2>>"$LOG"; then
  echo "device_check: the carried C++ extensions import" | tee -a "$LOG"
else
  echo "device_check: building the C++ extensions (at most ${BUILD_TIMEOUT_S:-240} s, see build.log)" | tee -a "$LOG"
  timeout "${BUILD_TIMEOUT_S:-240}" "$PY" setup.py build_ext --inplace --parallel "$(nproc)" >"$OUT/build.log" 2>&1 ||
    echo "device_check: the build failed or ran past ${BUILD_TIMEOUT_S:-240} s: the proof runs on torch's fallback Adam" | tee -a "$LOG"
fi
# The proof stops itself at its deadline; this bound only catches a hang past it.
timeout -k 5 $((${DEADLINE_S%.*} + 30)) "$PY" -m device_proof --out "$OUT" "${REHEARSAL[@]}" \
  --deadline-s "$DEADLINE_S" ${SECTIONS:+--sections "$SECTIONS"} 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] && echo "device_check: the proof ran past its deadline and was stopped; summary.txt has what finished" | tee -a "$LOG"
exit "$rc"
