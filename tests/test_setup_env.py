"""scripts/setup_env.sh and the tiny script's dry run, with a stand-in Python: set-up is a
no-op while the stamp matches (and its check imports no torch), reinstalls when the install
points at another checkout, shows the build's progress, says one line when pip refuses
(PEP 668); a failing dry run fails. The stamp itself (scripts/setup_stamp.py) and setup.py's
side-by-side build are checked with the real Python."""

import os
import subprocess
import sys

import pytest
from helpers import HANG_TIMEOUT, ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import setup_stamp  # noqa: E402

# A Python that records every call; its `import mp_offload` resolves to $WHERE, and the
# install step's build reports progress as setup.py does.
FAKE = """#!/bin/bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "pip $*" >>"$CALLS"
  if [ -n "${PEP668:-}" ]; then
    echo "error: externally-managed-environment" >&2; echo "x This environment is ..." >&2
    exit 1
  fi
  case "$*" in
    *"-e .[test]"*)
      echo "compiling csrc/a.cpp, csrc/b.cpp (2 at a time)" >>"$MP_OFFLOAD_BUILD_PROGRESS" ;;
  esac
  exit 0
fi
case "$1" in
  *setup_stamp.py)
    echo "stamp $*" >>"$CALLS"
    [ "$WHERE" = "$2/mp_offload" ] && echo "stamp-of-$WHERE" && exit 0
    echo "setup_stamp: import mp_offload finds $WHERE" >&2; exit 1 ;;
esac
echo "python $*" >>"$CALLS"
case "$2" in
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
        timeout=HANG_TIMEOUT,
    )
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    (tmp_path / "calls").unlink(missing_ok=True)
    return r, calls


def test_setup_is_a_noop_while_the_stamp_matches(tmp_path):
    r, calls = _setup(tmp_path)
    assert r.returncode == 0, r.stderr
    assert any("-e .[test]" in c for c in calls) and (tmp_path / "stamp").exists()
    assert all(line.startswith("setup_env: ") for line in r.stdout.splitlines())
    assert "setup_env:   compiling csrc/a.cpp, csrc/b.cpp (2 at a time)" in r.stdout.splitlines()
    r, calls = _setup(tmp_path)
    assert r.returncode == 0 and "up to date" in r.stdout
    # the check of a no-op is the stamp alone: no pip, no other Python (no torch import)
    assert [c.split()[0] for c in calls] == ["stamp"], calls
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


def _checkout(tmp_path):
    """A stand-in checkout whose package is built for this Python."""
    root = tmp_path / "co"
    (root / "csrc").mkdir(parents=True)
    (root / "mp_offload").mkdir()
    (root / "setup.py").write_text("setup()\n")
    (root / "pyproject.toml").write_text("[x]\n")
    (root / "csrc" / "a.cpp").write_text("int a;\n")
    (root / "mp_offload" / "__init__.py").write_text("")
    suffix = setup_stamp.sysconfig.get_config_var("EXT_SUFFIX")
    for name in setup_stamp.EXTENSIONS:
        (root / "mp_offload" / f"{name}{suffix}").write_bytes(b"")
    return root, str(root / "mp_offload")


def test_the_stamp_follows_the_sources_and_torch_and_checks_the_build(tmp_path):
    root, pkg = _checkout(tmp_path)
    assert setup_stamp.problem(str(root), pkg) is None
    first = setup_stamp.stamp(str(root), pkg, "2.13.0")
    assert setup_stamp.stamp(str(root), pkg, "2.13.0") == first
    assert setup_stamp.stamp(str(root), pkg, "2.11.0+cu130") != first  # another torch
    (root / "mp_offload" / "__init__.py").write_text("x = 1\n")  # editable: no rebuild
    assert setup_stamp.stamp(str(root), pkg, "2.13.0") == first
    (root / "mp_offload" / "new.py").write_text("")  # the file list changed
    second = setup_stamp.stamp(str(root), pkg, "2.13.0")
    assert second != first
    (root / "csrc" / "a.cpp").write_text("int b;\n")
    assert setup_stamp.stamp(str(root), pkg, "2.13.0") != second
    assert "finds /elsewhere/mp_offload, not" in setup_stamp.problem(
        str(root), "/elsewhere/mp_offload"
    )
    assert "finds nothing" in setup_stamp.problem(str(root), None)
    os.remove(os.path.join(pkg, "_cpu_adam" + setup_stamp.sysconfig.get_config_var("EXT_SUFFIX")))
    assert setup_stamp.problem(str(root), pkg).endswith("is not built")


def test_the_stamp_script_imports_neither_torch_nor_the_project(tmp_path):
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import setup_stamp; "
        "setup_stamp.main([sys.argv[2]]); "
        "print('torch' in sys.modules, 'mp_offload' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-c", code, os.path.join(ROOT, "scripts"), ROOT],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert r.stdout.split()[-2:] == ["False", "False"]


BUILD = """
import runpy, sys, threading
import setuptools
from setuptools.command.build_ext import build_ext as base
from setuptools.dist import Distribution

setuptools.setup = lambda **kw: kw
ns = runpy.run_path("setup.py")
barrier = threading.Barrier(len(ns["ext_modules"]), timeout=120)
built = []

def compile_one(self, ext):  # passes the barrier only if every extension is in flight at once
    barrier.wait()
    built.append(ext.name)

base.build_extension = compile_one
cmd = ns["ParallelBuildExt"](Distribution({"ext_modules": ns["ext_modules"], "name": "x"}))
cmd.initialize_options()
cmd.build_lib = cmd.build_temp = sys.argv[1]
cmd.finalize_options()
cmd.run()
print(cmd.parallel, *sorted(built))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core builds one at a time")
def test_setup_py_compiles_the_extensions_side_by_side_and_says_so(tmp_path):
    progress = tmp_path / "progress"
    env = dict(os.environ, MP_OFFLOAD_BUILD_PROGRESS=str(progress))
    r = subprocess.run(
        [sys.executable, "-c", BUILD, str(tmp_path / "build")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["2", "mp_offload._cpu_adam", "mp_offload._host_ops"]
    lines = progress.read_text().splitlines()
    assert lines[0] == "compiling csrc/cpu_adam.cpp, csrc/host_ops.cpp (2 at a time)"
    assert sorted(line.split()[0] for line in lines[1:]) == [
        "mp_offload._cpu_adam",
        "mp_offload._host_ops",
    ]


def test_the_test_script_starts_a_worker_per_usable_core(tmp_path):
    """scripts/test.sh sets OMP_NUM_THREADS=1 for the tests, which `nproc` honours: the
    workers are counted from the cores first."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "$@"\n')
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), SKIP_SETUP="1", OMP_NUM_THREADS="1")
    env.pop("PYTEST_WORKERS", None)
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts/test.sh"), "-x"],
        env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    cores = len(os.sched_getaffinity(0))
    assert r.stdout.split() == ["-m", "pytest", "-q", "-n", str(min(cores, 4)), "--dist"] + [
        "worksteal",
        "-x",
    ]


def test_tests_without_the_build_step_say_the_set_up_command_in_one_line(tmp_path):
    """C++ extensions not built (here: hidden from the import system at start-up, as if
    absent): pytest ends at once with one line naming the set-up command."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nsys.modules['mp_offload._cpu_adam'] = None  # not built\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         os.path.join(ROOT, "tests", "test_lint.py")],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT,
    )  # fmt: skip
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert lines == [
        "Exit: tests: no module mp_offload._cpu_adam (not set up): run bash scripts/setup_env.sh"
        " first"
    ]
