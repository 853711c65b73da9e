#!/usr/bin/env bash
# Install mp_offload, its dependencies and its test extras into the current Python
# (idempotent).
# A torch that is already installed is kept (a GPU user keeps their CUDA build).
# Without one: on a machine with an NVIDIA driver, PyPI's default (CUDA) torch;
# on a CPU-only machine, TORCH_CPU_SPEC (default torch==2.13.0, which resolves to a
# local CPU wheel on the project's machines; elsewhere install a CPU build first).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip_install torch
  else
    pip_install "${TORCH_CPU_SPEC:-torch==2.13.0}"
  fi
fi
pip_install numpy sentencepiece tqdm pyyaml pybind11 "setuptools>=64" wheel
# Always (re)register this checkout: another clone's editable install must not shadow it.
# The test extras (pytest, transformers, safetensors, tokenizers, matplotlib, ruff) come with it,
# so every test runs (only CUDA tests skip without a GPU) and the main job draws its plot.
pip_install --no-build-isolation -e ".[test]"
"$PY" -c "import torch, mp_offload._cpu_adam as c; print(f'mp_offload ready: torch {torch.__version__}, CPU Adam {c.simd_level()}')"
