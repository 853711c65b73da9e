"""Build mp_offload and its C++ extensions (pybind11, no torch headers): the CPU Adam and
the host-side gradient accumulation, compiled side by side."""

import os
import sys
import time
from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

# No -march=native: one build must run on every x86-64 host; the kernel picks
# AVX-512 / AVX2 / scalar paths at run time via per-function target attributes.
# -ffp-contract=off: keep the kernel's rounding identical to torch's on every target (no
# silent a*b+c -> fma contraction, e.g. by GCC on aarch64).
compile_args = ["-O3", "-fopenmp", "-std=c++17", "-ffp-contract=off"]

ext_modules = [
    Pybind11Extension(
        f"mp_offload._{name}",
        [f"csrc/{name}.cpp"],
        include_dirs=["csrc"],
        # The shared headers (simd.h, adam_kernels.h): setuptools rebuilds a module when
        # one of them changes and ships them in the sdist.
        depends=sorted(glob("csrc/*.h")),
        extra_compile_args=compile_args,
        extra_link_args=["-fopenmp"],
    )
    for name in ("cpu_adam", "host_ops")
]


def _progress(line: str) -> None:
    """A progress line on stderr, and in $MP_OFFLOAD_BUILD_PROGRESS (scripts/setup_env.sh
    shows that file's lines while pip, which hides the build's output, runs)."""
    sys.stderr.write(f"mp_offload build: {line}\n")  # one write: the builds run in threads
    sys.stderr.flush()
    path = os.environ.get("MP_OFFLOAD_BUILD_PROGRESS")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


class ParallelBuildExt(build_ext):
    """Compiles the extensions at the same time (one compiler each, up to the cores: the CPU
    Adam alone is minutes of CPU, and waited for the host ops before), saying what it does."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = max(1, min(len(self.extensions or ()), os.cpu_count() or 1))

    def build_extensions(self):
        names = ", ".join(src for ext in self.extensions for src in ext.sources)
        _progress(f"compiling {names} ({self.parallel} at a time)")
        super().build_extensions()

    def build_extension(self, ext):
        start = time.monotonic()
        super().build_extension(ext)
        _progress(f"{ext.name} ready after {time.monotonic() - start:.0f} s")


setup(
    name="mp_offload",
    version="0.1.0",
    description="Tensor-parallel GPT training with data-parallel ZeRO-Offload (CPU Adam)",
    python_requires=">=3.10",
    packages=find_packages(include=["mp_offload", "mp_offload.*"]),
    install_requires=["torch>=2.1", "numpy", "sentencepiece", "tqdm", "pyyaml"],
    # What the tests need beyond that (the Hugging Face export/import and tokenizer tests,
    # the loss plots, the lint test, scripts/test.sh's test workers); scripts/setup_env.sh
    # installs them, so only CUDA tests skip. ruff is pinned to a minor release: its
    # formatter's style changes between them, and tests/test_lint.py holds the tree to one
    # style.
    extras_require={
        "test": [
            "pytest",
            "pytest-xdist",
            "transformers",
            "safetensors",
            "tokenizers",
            "matplotlib",
            "tqdm",
            "pyyaml",
            "ruff>=0.17.6,<0.18",
        ]
    },
    ext_modules=ext_modules,
    cmdclass={"build_ext": ParallelBuildExt},
)
