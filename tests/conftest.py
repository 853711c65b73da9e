import importlib.util
import os
import sys

import pytest

SETUP = "bash scripts/setup_env.sh"


def missing_build() -> str | None:
    """The first of torch and the C++ extensions this Python cannot import (found, not
    imported), or None."""
    for name in ("torch", "mp_offload._cpu_adam", "mp_offload._host_ops"):
        try:
            found = importlib.util.find_spec(name)
        except ImportError:
            found = None
        if found is None:
            return name
    return None


_MISSING = missing_build()

# Tests run many ranks on two cores: one thread each, and helpers importable by spawned ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Idle OpenMP threads sleep, in this process and the ranks it starts (as mp_offload's own
# import arranges; here torch is imported first). Read when the runtime loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if _MISSING is None:
    import torch

# The gloo tests run on the CPU even on a GPU machine (more ranks than GPUs there);
# the CUDA tests ask for the device explicitly (--device cuda).
os.environ.setdefault("MP_OFFLOAD_DEVICE", "cpu")
sys.path.insert(0, os.path.dirname(__file__))
# The device proof (device_proof/, beside bench/) is not part of the installed package.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    """Without the build step, one line naming it instead of an ImportError per module."""
    if _MISSING is not None:
        pytest.exit(f"tests: no module {_MISSING} (not set up): run {SETUP} first", returncode=4)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# The small tokenizers of the tokenizer tests (tests/tokenizer_inputs.py), trained once.
@pytest.fixture(scope="session")
def sp_model(tmp_path_factory):
    from tokenizer_inputs import small_sentencepiece

    return small_sentencepiece(tmp_path_factory.mktemp("sp"))


@pytest.fixture(scope="session")
def bbpe_dir(tmp_path_factory):
    from tokenizer_inputs import small_bpe_bytelevel

    return small_bpe_bytelevel(tmp_path_factory.mktemp("bbpe"))
