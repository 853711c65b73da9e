#!/usr/bin/env bash
# The checks that need a GPU, in one go (< 8 minutes on one H100/H200-class GPU):
#   1. pytest -m cuda (every CUDA test of the suite)
#   2. three short 1.3B runs (24 x 2048, seq 2048, micro-batch 4, bf16, mock data):
#      no offload, --cpu-offload, --cpu-offload + DPU, each logging JSON
#   3. one table, with asserts: the first losses agree across the three runs, host<->device
#      bytes/param are 0 / 4 / 4, pinned host memory is 0 without offload and exactly the
#      planner's staging with it, offload uses less device memory, DPU is not slower.
# No "largest model" run: that needs the whole machine for longer than a check has.
#
# Exit: 0 all good; 1 a check failed; 2 this machine cannot run the checks (no GPU, or the
# C++ Adam did not build), said in one line.
# Environment: ITERS (8), MICRO_BATCH (4), OUT (a temporary directory; logs land there),
# PYTHON.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "device_check: error: no CUDA device visible to torch (nvidia-smi, CUDA_VISIBLE_DEVICES)" >&2
  exit 2
fi
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
ITERS=${ITERS:-8}
MB=${MICRO_BATCH:-4}
# The C++ Adam is a build output (not in git): build it in place if it is missing.
"$PY" -c "import mp_offload._cpu_adam" 2>/dev/null || \
  "$PY" setup.py build_ext --inplace -q >"$OUT/build.log" 2>&1
if ! "$PY" -c "import mp_offload._cpu_adam" 2>/dev/null; then
  echo "device_check: error: the C++ CPU Adam did not build (see $OUT/build.log)" >&2
  exit 2
fi
status=0
"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); \
print(f'device_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, \
CUDA {torch.version.cuda}')"

echo "== 1. pytest -m cuda =="
timeout 240 "$PY" -m pytest -q -m cuda tests/ 2>&1 | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

MODEL=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
       --max-position-embeddings 2048 --vocab-size 50257 --micro-batch-size "$MB"
       --global-batch-size "$MB" --bf16 --hidden-dropout 0.0 --attention-dropout 0.0)
RUN=(--mock-data --tokenizer-type NullTokenizer --train-iters "$ITERS" --lr 1e-4
     --log-interval 1 --eval-interval 100000 --eval-iters 1 --device cuda)
GB=$("$PY" -c "import torch; print(torch.cuda.get_device_properties(0).total_memory / 2**30)")
HOST=$("$PY" -c "import os; print(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30)")

for mode in no-offload offload offload-dpu; do
  extra=()
  # F=1 said explicitly: the planner would otherwise plan the share it would keep on the device
  [ "$mode" != no-offload ] && extra=(--cpu-offload --optimizer-offload-fraction 1)
  [ "$mode" = offload-dpu ] && extra+=(--dpu-warmup-steps 2)
  echo "== 2. 1.3B, $ITERS iterations, $mode =="
  log="$OUT/1.3b_$mode.jsonl"
  rm -f "$log"
  timeout 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py \
    "${MODEL[@]}" "${RUN[@]}" "${extra[@]}" --log-json "$log" >"$OUT/1.3b_$mode.out" 2>&1
  rc=$?
  tail -2 "$OUT/1.3b_$mode.out"
  [ $rc -eq 0 ] || { echo "run failed (rc $rc): $OUT/1.3b_$mode.out"; status=1; }
  "$PY" -m mp_offload.plan "${MODEL[@]}" "${extra[@]}" --json --device-memory-gb "$GB" \
    --host-memory-gb "$HOST" --devices-per-node 1 >"$OUT/plan_$mode.json" 2>"$OUT/plan_$mode.err"
done

echo "== 3. 1.3B, micro-batch $MB, seq 2048, bf16: measured (medians from iteration 3) =="
"$PY" - "$OUT" <<'PYEOF' || status=1
import json, os, statistics, sys
out = sys.argv[1]
modes = ("no-offload", "offload", "offload-dpu")
rows, problems = {}, []
for m in modes:
    path = os.path.join(out, f"1.3b_{m}.jsonl")
    recs = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    recs = [r for r in recs if "tflops_per_device" in r]
    if not recs:
        problems.append(f"{m}: no iterations logged"); continue
    steady = recs[2:] or recs
    plan = json.load(open(os.path.join(out, f"plan_{m}.json")))
    rows[m] = dict(first_loss=recs[0]["loss"], ms=statistics.median(r["elapsed_ms"] for r in steady),
                   tflops=statistics.median(r["tflops_per_device"] for r in steady),
                   dev=max(r["peak_device_gb"] for r in recs), rss=max(r["peak_host_gb"] for r in recs),
                   pinned=recs[-1].get("pinned_host_bytes", 0) / 1e9,
                   bpp=recs[-1].get("host_device_bytes_per_param", 0.0),
                   plan_staging=plan["host"].get("staging", 0) / 1e9,
                   plan_dev=plan["device_total"] / 1e9)
print(f"{'mode':<12} {'ms/iter':>8} {'TFLOPS':>7} {'peak dev GB':>11} {'plan dev GB':>11} "
      f"{'host RSS GB':>11} {'pinned GB':>9} {'plan pin GB':>11} {'B/param':>7} {'loss@1':>8}")
for m, r in rows.items():
    print(f"{m:<12} {r['ms']:8.1f} {r['tflops']:7.1f} {r['dev']:11.2f} {r['plan_dev']:11.2f} "
          f"{r['rss']:11.2f} {r['pinned']:9.3f} {r['plan_staging']:11.3f} {r['bpp']:7.2f} "
          f"{r['first_loss']:8.4f}")
if len(rows) == 3:
    first = [r["first_loss"] for r in rows.values()]
    if max(first) - min(first) > 1e-5 * abs(first[0]):
        problems.append(f"first losses differ: {first}")
    for m, want in (("no-offload", 0.0), ("offload", 4.0), ("offload-dpu", 4.0)):
        if abs(rows[m]["bpp"] - want) > 0.01:
            problems.append(f"{m}: {rows[m]['bpp']:.2f} host<->device B/param, expected {want}")
    if rows["no-offload"]["pinned"] != 0:
        problems.append("no-offload pinned host memory")
    for m in ("offload", "offload-dpu"):
        if abs(rows[m]["pinned"] - rows[m]["plan_staging"]) > 1e-6:
            problems.append(f"{m}: pinned {rows[m]['pinned']:.6f} GB, planner says "
                            f"{rows[m]['plan_staging']:.6f} GB")
    if rows["offload"]["dev"] >= rows["no-offload"]["dev"]:
        problems.append("offload does not lower peak device memory")
    if rows["offload-dpu"]["ms"] > 1.10 * rows["offload"]["ms"]:
        problems.append("DPU is slower than plain offload")
for p in problems:
    print("CHECK FAILED:", p)
sys.exit(1 if problems else 0)
PYEOF
echo "logs: $OUT"
exit $status
