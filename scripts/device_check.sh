#!/usr/bin/env bash
# The device proof: the checks only a GPU can settle, in stages with their own timeouts
# (about 9.5 minutes in all on one H200; it installs nothing and builds the C++ extensions
# in place):
#   1. preflight  versions, nvidia-smi, affinity, the build; calibration into calib.json
#                 (pinned D2H/H2D GB/s, host stream GB/s, bf16 GEMM TFLOPS, usable host memory)
#   2. pytest     pytest -m cuda: the CUDA tests, tests/test_cuda_proof.py among them
#   3. runs       seven 1.3B runs (no offload; offload k=1; + DPU; k=8 accumulated on the
#                 device + DPU; and at k=8 without clipping: no offload, offload, offload
#                 with --overlap-cpu-optimizer): losses, host<->device bytes, pinned and
#                 reserved memory against the plan, DPU against sync, TFLOPS against the
#                 throughput model, practicality (no-offload step / offload step, >= 0.9
#                 with the overlap) and the overlapped losses bitwise the synchronous ones
#   4. profile    one profiled offload step: the share of D2H copy time under other kernels
#   5. host_adam  bench/bench_cpu_adam.py --rows: the remainder and 8-bit moment rows on all
#                 host cores (50M elements), each >= 0.90 of the ceiling for its own bytes
#                 (many cores: DRAM-bound; in the rehearsal recorded only)
# The logic lives in mp_offload/device_proof/ (one module per stage's concern).
#
# --cpu-rehearsal: every stage at a tiny size with the CPU as the device (gloo, the CPU copy
# path, calibration on the CPU), so the stages, parsing, asserts and summary are proven on
# any machine before a GPU minute is spent.
#
# Writes OUT (default a temporary directory): proof.log, summary.json (checks: a list of
# {name, passed, value, expected}; not_covered: what one GPU cannot prove), calib.json, the
# runs' logs. Exit: 0 every check passed; 1 a check failed; 2 no GPU (without
# --cpu-rehearsal) or a bad argument. Environment: OUT, PYTHON.
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
rm -f "$OUT"/stage_*.json "$OUT/summary.json"
LOG="$OUT/proof.log"
: >"$LOG"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, built in place
if [ ${#REHEARSAL[@]} -eq 1 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  # the build, preflight, pytest, runs, profile, host_adam timeouts (seconds) for a 2-core machine
  LIMITS=(180 120 240 540 120 120)
else
  # 9.5 minutes at most on one H200 (each run of stage 3: 42 s at most, runs.py)
  LIMITS=(50 40 110 300 40 30)
fi
{
  echo "device_check: $(date -u +%FT%TZ) ${REHEARSAL[*]:-on the GPU}, logs in $OUT"
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  echo "== build (in place) =="
} 2>&1 | tee -a "$LOG"
timeout "${LIMITS[0]}" "$PY" setup.py build_ext --inplace -q >"$OUT/build.log" 2>&1 ||
  echo "device_check: the build failed or ran past ${LIMITS[0]} s (see $OUT/build.log)" | tee -a "$LOG"
i=1
for stage in preflight pytest runs profile host_adam; do
  echo "== $stage (at most ${LIMITS[$i]} s) ==" | tee -a "$LOG"
  start=$SECONDS
  timeout -k 10 "${LIMITS[$i]}" "$PY" -m mp_offload.device_proof "$stage" --out "$OUT" "${REHEARSAL[@]}" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "device_check: stage $stage ran past ${LIMITS[$i]} s" | tee -a "$LOG"
  echo "device_check: stage $stage: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
  i=$((i + 1))
done
echo "== summary ==" | tee -a "$LOG"
"$PY" -m mp_offload.device_proof summary --out "$OUT" "${REHEARSAL[@]}" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
