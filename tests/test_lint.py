"""One linter and one formatter over the whole tree: ``ruff check`` and ``ruff format``
(configured in pyproject.toml) must pass, so a change that breaks either fails here and
not only in a reviewer's checkout."""

import subprocess
import sys

import pytest
from helpers import ROOT


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_is_clean(command):
    res = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, f"ruff {' '.join(command)} .:\n{res.stdout}{res.stderr}"
