#!/usr/bin/env bash
# Install mp_offload, its dependencies and its test extras into the current Python, saying
# what it does (one line per step). A no-op (seconds) when nothing changed: the install
# is stamped with a hash of the sources (setup.py, pyproject.toml, csrc/*, the package's
# file list) and of the Python and torch it was built for, kept in build/setup_env.stamp;
# it reinstalls when that differs, when the C++ extensions do not import, or when
# `import mp_offload` resolves to another checkout.
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
trap 'rm -f "$ERR"' EXIT

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

# The stamp: the sources the install is built from and the Python/torch it is built for;
# fails (prints nothing) unless an import from outside this checkout finds this checkout's
# package with its extensions built.
stamp() {
  local where
  where=$(cd / && env -u PYTHONPATH "$PY" -c "
import os, sys, torch
import mp_offload, mp_offload._cpu_adam, mp_offload._host_ops
print(sys.version, sys.prefix, torch.__version__, os.path.dirname(mp_offload.__file__))" \
    2>/dev/null) || return 1
  [[ "$where" == *" $ROOT/mp_offload" ]] || return 1
  { cat setup.py pyproject.toml csrc/*; find mp_offload -name '*.py' | LC_ALL=C sort; echo "$where"; } |
    sha256sum | cut -d' ' -f1
}

say "checking the installed project against this checkout ($ROOT)"
if [ "${FORCE_SETUP:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(stamp || echo none)" ]; then
  say "up to date (nothing to do; FORCE_SETUP=1 reinstalls)"
  exit 0
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    spec=${TORCH_CUDA_SPEC:-torch==2.11.0}
    index=${TORCH_CUDA_INDEX:-https://download.pytorch.org/whl/cu130}
    say "installing $spec (CUDA build from $index; several GB)"
    pip_install "$spec" --index-url "$index"
  else
    spec=${TORCH_CPU_SPEC:-torch==2.13.0}
    say "installing $spec (CPU)"
    pip_install "$spec"
  fi
fi
say "installing the dependencies (numpy, sentencepiece, tqdm, pyyaml, pybind11, setuptools)"
pip_install numpy sentencepiece tqdm pyyaml pybind11 "setuptools>=64" wheel
# This checkout, editable: another clone's editable install must not shadow it. The test
# extras (pytest, transformers, safetensors, tokenizers, matplotlib, ruff) come with it, so
# every test runs (only CUDA tests skip without a GPU) and the main job draws its plot.
say "installing this checkout (pip install -e .[test]: builds the C++ Adam; about a minute)"
pip_install --no-build-isolation -e ".[test]"
mkdir -p build
if ! now=$(stamp); then
  echo "setup_env: error: after installing, 'import mp_offload' from outside $ROOT does not" \
       "find this checkout with its C++ extensions (is PYTHONPATH or another install in the way?)" >&2
  exit 1
fi
echo "$now" >"$STAMP"
"$PY" -c "import torch, mp_offload._cpu_adam as c; print(f'setup_env: mp_offload ready: torch {torch.__version__}, CPU Adam {c.simd_level()}')"
