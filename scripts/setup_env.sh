#!/usr/bin/env bash
# Install mp_offload, its dependencies and its test extras into the current Python, saying
# what it does (one line per step, and a line every 20 s while a step runs). A no-op (a
# fraction of a second, no torch import) when nothing changed: the install is stamped with
# a hash of the sources (setup.py, pyproject.toml, csrc/*, the package's file list) and of
# the Python and torch it was built for, kept in build/setup_env.stamp; it reinstalls when
# that differs, when the C++ extensions are not built, or when `import mp_offload` resolves
# to another checkout (scripts/setup_stamp.py checks all three from files alone).
#
# A torch that is already installed is kept (a GPU user keeps their CUDA build). Without one:
# on a machine with an NVIDIA driver, TORCH_CUDA_SPEC (default torch==2.11.0) from
# TORCH_CUDA_INDEX (default PyTorch's CUDA 13.0 wheels), the build the device proof
# (scripts/device_check.sh) targets; on a CPU-only machine, TORCH_CPU_SPEC (default
# torch==2.13.0, a local CPU wheel on the project's machines). FORCE_SETUP=1 reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
STAMP=${SETUP_STAMP:-build/setup_env.stamp}  # SETUP_STAMP: for the tests
say() { echo "setup_env: $*"; }
ERR=$(mktemp)

pip_install() {
  if ! "$PY" -m pip install --disable-pip-version-check -q "$@" 2>"$ERR"; then
    if grep -q "externally-managed-environment" "$ERR"; then
      echo "setup_env: error: this Python's pip refuses to install packages (PEP 668," \
           "externally managed); make a venv first: python3 -m venv .venv && . .venv/bin/activate" >&2
    else
      cat "$ERR" >&2
      echo "setup_env: error: pip install $* failed (above)" >&2
    fi
    exit 1
  fi
}

# with_progress WHAT CMD...: run CMD, showing the build's progress lines (setup.py writes
# them to $MP_OFFLOAD_BUILD_PROGRESS: pip hides the build's own output) and, every 20 s,
# how long WHAT has been running. CMD's exit status.
PROGRESS=$(mktemp)
trap 'rm -f "$ERR" "$PROGRESS"' EXIT
with_progress() {
  local what=$1 start=$SECONDS shown=0 next=20 pid lines
  shift
  : >"$PROGRESS"
  MP_OFFLOAD_BUILD_PROGRESS=$PROGRESS "$@" &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    lines=$(wc -l <"$PROGRESS")
    if [ "$lines" -gt "$shown" ]; then
      sed -n "$((shown + 1)),${lines}p" "$PROGRESS" | sed 's/^/setup_env:   /'
      shown=$lines
    fi
    if [ $((SECONDS - start)) -ge "$next" ]; then
      say "  $what: $((SECONDS - start)) s so far"
      next=$((next + 20))
    fi
  done
  wait "$pid" || return $?
  sed -n "$((shown + 1)),\$p" "$PROGRESS" | sed 's/^/setup_env:   /'
}

# The stamp (scripts/setup_stamp.py, files only): fails, with one line saying why, unless
# an import from outside this checkout finds this checkout's package with its extensions.
stamp() {
  (cd / && env -u PYTHONPATH "$PY" "$ROOT/scripts/setup_stamp.py" "$ROOT")
}

say "checking the installed project against this checkout ($ROOT)"
if [ "${FORCE_SETUP:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(stamp 2>/dev/null || echo none)" ]; then
  say "up to date (nothing to do; FORCE_SETUP=1 reinstalls)"
  exit 0
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    spec=${TORCH_CUDA_SPEC:-torch==2.11.0}
    index=${TORCH_CUDA_INDEX:-https://download.pytorch.org/whl/cu130}
    say "installing $spec (CUDA build from $index; several GB)"
    with_progress "installing torch" pip_install "$spec" --index-url "$index"
  else
    spec=${TORCH_CPU_SPEC:-torch==2.13.0}
    say "installing $spec (CPU)"
    with_progress "installing torch" pip_install "$spec"
  fi
fi
say "installing the dependencies (numpy, sentencepiece, tqdm, pyyaml, pybind11, setuptools)"
with_progress "installing the dependencies" \
  pip_install numpy sentencepiece tqdm pyyaml pybind11 "setuptools>=64" wheel
# This checkout, editable: another clone's editable install must not shadow it. The test
# extras (pytest, transformers, safetensors, tokenizers, matplotlib, ruff) come with it, so
# every test runs (only CUDA tests skip without a GPU) and the main job draws its plot.
say "installing this checkout (pip install -e .[test]: compiles the C++ Adam and host ops side" \
    "by side, about 1-2 minutes on 2 cores)"
with_progress "installing this checkout" pip_install --no-build-isolation -e ".[test]"
mkdir -p build
if ! now=$(stamp); then
  echo "setup_env: error: after installing, 'import mp_offload' from outside $ROOT does not" \
       "find this checkout with its C++ extensions (is PYTHONPATH or another install in the way?)" >&2
  exit 1
fi
echo "$now" >"$STAMP"
"$PY" -c "import torch, mp_offload._cpu_adam as c; print(f'setup_env: mp_offload ready: torch {torch.__version__}, CPU Adam {c.simd_level()}')"
