"""scripts/torchrun_quiet.py: torchrun without its own failure report,
and common.sh's MASTER_PORT check."""

import os
import signal
import socket
import subprocess
import sys

import pytest
from pretrain_runs import TINY, pretrain_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = os.path.join(ROOT, "scripts", "torchrun_quiet.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from torchrun_quiet import Filter  # noqa: E402

# torchrun's report after a worker's clean one-line error (abridged from a real one)
REPORT = """\
pretrain_gpt.py: error: --hidden-size 30 is not divisible by --num-attention-heads 4
E1201 20:19:45.430000 18162 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] \
failed (exitcode: 2) local_rank: 0 (pid: 18279) of binary: python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/torch/distributed/run.py", line 1032, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
pretrain_gpt.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  exitcode  : 2 (pid: 18279)
============================================================
"""
BUG = (
    'Traceback (most recent call last):\n  File "/x/pretrain_gpt.py", line 14, in <module>\n'
    "ZeroDivisionError: division by zero\n"
)


def _filtered(text: str) -> str:
    f = Filter()
    out = [o for line in text.splitlines(True) for o in f.feed(line)] + f.flush()
    return "".join(out)


def test_torchruns_report_is_dropped_and_a_workers_traceback_kept():
    banner = "W1201 20:19:40.1 1 site-packages/torch/distributed/run.py:1] \n" + "*" * 40 + "\n"
    assert _filtered(banner + REPORT) == REPORT.splitlines(True)[0]
    assert _filtered(BUG + REPORT) == BUG + REPORT.splitlines(True)[0]


def test_torchruns_omp_num_threads_banner_is_dropped_and_the_workers_lines_kept():
    rule = "*" * 41 + "\n"
    notice = "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default\n"
    workers = "host threads 1; CPU Adam avx2\n\n*not a rule*\n"
    assert _filtered("\n" + rule + notice + rule + workers) == workers


@pytest.mark.slow
def test_a_bad_flag_under_torchrun_is_the_only_line():
    res = subprocess.run(
        [sys.executable, QUIET, "--standalone", "--nproc-per-node", "2", "pretrain_gpt.py"]
        + [*TINY, "--mock-data", "--train-iters", "2", "--hidden-size", "30"],
        capture_output=True, text=True, timeout=120, env=pretrain_env(), cwd=ROOT,
    )  # fmt: skip
    assert res.returncode != 0
    assert (
        res.stderr
        == "pretrain_gpt.py: error: --hidden-size 30 is not divisible by --num-attention-heads 4\n"
    )


@pytest.mark.slow
def test_ctrl_c_saves_and_exits_130_with_the_projects_line_last(tmp_path):
    job = subprocess.Popen(
        [sys.executable, QUIET, "--standalone", "--nproc-per-node", "2", "pretrain_gpt.py"]
        + [*TINY, "--mock-data", "--train-iters", "100000", "--save", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=pretrain_env(), cwd=ROOT,
        start_new_session=True,  # a terminal's Ctrl-C reaches the whole process group
    )  # fmt: skip
    for line in job.stdout:
        if "iteration      3/100000" in line:
            break
    os.killpg(job.pid, signal.SIGINT)
    rest, _ = job.communicate(timeout=120)
    assert job.returncode == 130, rest[-2000:]
    assert "stop requested: exiting after iteration" in rest and "Traceback" not in rest, rest
    assert rest.rstrip().splitlines()[-1].startswith("   checkpoint  "), rest[-1000:]


def test_common_sh_refuses_a_master_port_in_use():
    with socket.create_server(("", 0)) as s:
        port = s.getsockname()[1]
        res = subprocess.run(
            ["bash", "-c", f"source scripts/common.sh; check_port {port}"],
            capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHON=sys.executable),
        )  # fmt: skip
    assert res.returncode == 2
    assert f"MASTER_PORT {port} is in use on this host (another job?)" in res.stderr, res.stderr


def test_the_readmes_launch_examples_go_through_the_quiet_launcher():
    """A newcomer copies the README's commands: an error must stay one line there too."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    blocks = text.split("```")[1::2]
    commands = [line.strip() for b in blocks for line in b.splitlines()]
    assert not [c for c in commands if c.startswith("torchrun ")]
    assert sum("scripts/torchrun_quiet.py --nproc-per-node" in c for c in commands) == 3
