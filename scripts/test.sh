#!/usr/bin/env bash
# The test command of the README: set up, then the whole suite (CPU, gloo; CUDA tests skip).
# SKIP_SETUP=1 runs the suite with this Python as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup_env.sh
# The usable cores, counted before OMP_NUM_THREADS is set: nproc honours it.
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
export OMP_NUM_THREADS=1
# Test processes (pytest-xdist; work stealing keeps them all busy to the end): most
# of the suite's time is spent waiting (process start-up, torch imports, gloo rendezvous),
# so two workers on two cores take about half the time. At most 4: each multi-process test
# starts up to 4 ranks of its own. PYTEST_WORKERS=0 runs them in this one process.
workers=${PYTEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
exec "${PYTHON:-python3}" -m pytest -q -n "$workers" --dist worksteal "$@"
