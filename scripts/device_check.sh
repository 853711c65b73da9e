#!/usr/bin/env bash
# The checks that need a GPU, in one go (< 8 minutes on one H100/H200-class GPU):
#   1. pytest -m cuda (every CUDA test of the suite, incl. the planner's activation test)
#   2. a short 1.3B run (24 x 2048, seq 2048, micro-batch 4, bf16, mock data) without
#      and with --cpu-offload, logging JSON
#   3. measured TFLOPS/GPU and peak device memory beside the planner's prediction
# Without CUDA it says so and exits 0.
#
# Environment: ITERS (6), MICRO_BATCH (4), DEVICE_TFLOPS (400: sustained bf16 of an
# H100/H200-class GPU, for the throughput model), PCIE_GBS (50), HOST_MEM_GBS (200),
# OUT (a temporary directory; logs land there), PYTHON.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "device_check: no CUDA device here: nothing to check (exit 0)"
  exit 0
fi
OUT=${OUT:-$(mktemp -d)}
ITERS=${ITERS:-6}
MB=${MICRO_BATCH:-4}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
status=0

# The C++ Adam is a build output (not in git): build it in place if it is missing.
"$PY" -c "import mp_offload._cpu_adam" 2>/dev/null || \
  "$PY" setup.py build_ext --inplace -q >"$OUT/build.log" 2>&1 || \
  echo "device_check: C++ Adam did not build (see $OUT/build.log); offload uses torch's Adam"

echo "== 1. pytest -m cuda =="
timeout 200 "$PY" -m pytest -q -m cuda tests/ 2>&1 | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

MODEL=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
       --max-position-embeddings 2048 --vocab-size 50257 --micro-batch-size "$MB"
       --global-batch-size "$MB" --bf16 --hidden-dropout 0.1 --attention-dropout 0.1)
RUN=(--mock-data --tokenizer-type NullTokenizer --train-iters "$ITERS" --lr 1e-4
     --log-interval 1 --eval-interval 100000 --eval-iters 1)
GB=$("$PY" -c "import torch; print(torch.cuda.get_device_properties(0).total_memory / 2**30)")
HOST=$("$PY" -c "import os; print(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
                                  / 2**30)")

report() {  # report NAME LOG PLAN_JSON [THROUGHPUT_TABLE]
  "$PY" - "$@" <<'PYEOF'
import json, statistics, sys
name, log, plan = sys.argv[1:4]
tp_table = sys.argv[4] if len(sys.argv) > 4 else None
recs = [json.loads(l) for l in open(log) if '"tflops_per_device"' in l]
if not recs:
    print(f"{name}: no iterations logged"); sys.exit(1)
tf = statistics.median(r["tflops_per_device"] for r in recs[2:] or recs)
peak = max(r["peak_device_gb"] for r in recs) * 1e9 / 2**30
p = json.load(open(plan))
reserved = 1.0  # the planner's fixed workspace (CUDA context etc.) is not in the allocator
pred = p["device_total"] / 2**30 - reserved
act = p["device"]["activations"] / 2**30
pred_tf = "-"
if tp_table:
    rows = [l.split() for l in open(tp_table) if l.strip().startswith("1 ")]
    pred_tf = rows[0][10] if rows else "-"
print(f"{name:<12} measured {tf:7.1f} TFLOPS/GPU (model: {pred_tf:>5}) | peak allocated "
      f"{peak:6.2f} GiB, planned {pred:6.2f} GiB (of which activations {act:.2f}) "
      f"-> {100 * (pred - peak) / peak:+.0f}%")
PYEOF
}

for mode in no-offload offload; do
  extra=()
  [ "$mode" = offload ] && extra=(--cpu-offload)
  echo "== 2. 1.3B, $ITERS iterations, $mode =="
  log="$OUT/1.3b_$mode.jsonl"
  rm -f "$log"
  timeout 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py \
    "${MODEL[@]}" "${RUN[@]}" "${extra[@]}" --log-json "$log" >"$OUT/1.3b_$mode.out" 2>&1
  rc=$?
  tail -3 "$OUT/1.3b_$mode.out"
  [ $rc -eq 0 ] || { echo "run failed (rc $rc): $OUT/1.3b_$mode.out"; status=1; continue; }
  "$PY" -m mp_offload.plan "${MODEL[@]}" "${extra[@]}" --json --device-memory-gb "$GB" \
    --host-memory-gb "$HOST" --devices-per-node 1 >"$OUT/plan_$mode.json"
  tp=""
  if [ "$mode" = offload ]; then
    "$PY" -m mp_offload.plan "${MODEL[@]}" --throughput --throughput-model flags --gpus 1 \
      --batch-per-gpu "$MB" --device-tflops "${DEVICE_TFLOPS:-400}" --pcie-gbs "${PCIE_GBS:-50}" \
      --host-mem-gbs "${HOST_MEM_GBS:-200}" --cpu-cores-per-node "$(nproc)" \
      --tp-devices-per-node 1 >"$OUT/throughput.txt" && tp="$OUT/throughput.txt"
  fi
  report "$mode" "$log" "$OUT/plan_$mode.json" $tp >>"$OUT/summary.txt" || status=1
done

echo "== 3. measured vs planned (1.3B, micro-batch $MB, seq 2048, bf16) =="
cat "$OUT/summary.txt" 2>/dev/null
echo "logs: $OUT"
exit $status
