"""scripts/setup_env.sh and the tiny script's dry run, with a stand-in Python: set-up is a
no-op while the stamp matches, reinstalls when the install points at another checkout,
says one line when pip refuses (PEP 668); a failing dry run fails."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A Python that records every pip call; its `import mp_offload` resolves to $WHERE.
FAKE = """#!/bin/bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "pip $*" >>"$CALLS"
  if [ -n "${PEP668:-}" ]; then
    echo "error: externally-managed-environment" >&2; echo "x This environment is ..." >&2
    exit 1
  fi
  exit 0
fi
case "$2" in
  *"os.path.dirname(mp_offload.__file__)"*) echo "3.11 /venv 2.13.0 $WHERE" ;;
  *"mp_offload ready"*) echo "setup_env: mp_offload ready: torch 2.13.0, CPU Adam avx2" ;;
esac
exit 0
"""


def _setup(tmp_path, **env):
    fake = tmp_path / "python"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    env = {
        **os.environ,
        "PYTHON": str(fake),
        "CALLS": str(tmp_path / "calls"),
        "SETUP_STAMP": str(tmp_path / "stamp"),
        "WHERE": os.path.join(ROOT, "mp_offload"),
        **env,
    }
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts/setup_env.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    (tmp_path / "calls").unlink(missing_ok=True)
    return r, calls


def test_setup_is_a_noop_while_the_stamp_matches(tmp_path):
    r, calls = _setup(tmp_path)
    assert r.returncode == 0, r.stderr
    assert any("-e .[test]" in c for c in calls) and (tmp_path / "stamp").exists()
    assert all(line.startswith("setup_env: ") for line in r.stdout.splitlines())
    r, calls = _setup(tmp_path)
    assert r.returncode == 0 and calls == [] and "up to date" in r.stdout
    # the installed package resolves to another checkout: reinstall
    r, calls = _setup(tmp_path, WHERE="/elsewhere/mp_offload")
    assert any("-e .[test]" in c for c in calls)
    r, calls = _setup(tmp_path, FORCE_SETUP="1")
    assert any("-e .[test]" in c for c in calls)


def test_pip_refusing_pep668_gives_one_line(tmp_path):
    r, _ = _setup(tmp_path, PEP668="1")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "setup_env: error: this Python's pip refuses to install packages (PEP 668, externally"
        " managed); make a venv first: python3 -m venv .venv && . .venv/bin/activate"
    ]


def test_a_failing_tiny_dry_run_fails():
    env = dict(os.environ, DRY_RUN="1", SKIP_SETUP="1", PYTHON=sys.executable)
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts/pretrain_gpt_tiny_cpu.sh"), "--hidden-size", "255"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--hidden-size 255" in r.stderr
