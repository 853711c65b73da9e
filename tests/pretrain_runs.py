"""pretrain_gpt.py run as a user runs it, for the tests of its failures and stops: the
tiny model's flags, an environment without a launcher's variables, the one-error-line
check, and a snapshot of the files a run leaves."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

from helpers import ROOT, tiny_model_flags

from mp_offload.runtime.distributed import without_launcher

PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")
# vocabulary 96 (NullTokenizer: 97 ids with its EOD)
TINY = tiny_model_flags() + [
    "--micro-batch-size",
    "2",
    "--log-interval",
    "1",
    "--eval-interval",
    "1000",
    "--eval-iters",
    "1",
]
ERROR = "pretrain_gpt.py: error: "


def pretrain_env(**extra) -> dict:
    """This environment less a launcher's variables (a test under torchrun must not hand
    them on), one thread, no warnings, the CPU; plus ``extra``."""
    env = without_launcher(os.environ)
    return dict(env, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MP_OFFLOAD_DEVICE="cpu", **extra)


def run_pretrain(*args, timeout=240, **env):
    return subprocess.run(
        [sys.executable, PRETRAIN, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=pretrain_env(**env),
        cwd=ROOT,
    )


def assert_one_line(res, needle: str, code: int) -> str:
    """Exit ``code``; exactly one error line, holding ``needle``; no traceback."""
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith(ERROR)]
    assert res.returncode == code and len(errors) == 1, (res.returncode, res.stderr[-3000:])
    assert needle in errors[0], errors[0]
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    return errors[0]


def snapshot(root) -> dict:
    """Every file under ``root`` and its sha256."""
    out = {}
    for where, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(where, n), "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(os.path.join(where, n), root)] = digest
    return out
