#!/usr/bin/env bash
# The test command of the README: set up, then the whole suite (CPU, gloo; CUDA tests skip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1
exec "${PYTHON:-python3}" -m pytest -q "$@"
