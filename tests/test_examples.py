"""The scripts in examples/ run as their docstrings say: one process and torchrun."""

import os
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow  # each runs a script in a subprocess (torchrun for DP=2)


def _run(*cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=ROOT)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout


def _torchrun(script, *args):
    return _run(sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", os.path.join(ROOT, "examples", script), *args)  # fmt: skip


def _losses(out: str) -> list[float]:
    return [
        float(line.split("| loss ")[1].split()[0]) for line in out.splitlines() if "| loss " in line
    ]


def test_own_module_one_process_and_dp2():
    """The same 20 steps at DP=1 and DP=2 (half a batch each): the loss falls in both; the
    global gradient norms agree (one model, the same batches)."""
    one = _run(sys.executable, os.path.join(ROOT, "examples", "own_module.py"))
    two = _torchrun("own_module.py")
    for out in (one, two):
        losses = _losses(out)
        assert len(losses) == 5 and losses[-1] < 0.5 * losses[0], out
        assert "host bytes per parameter on rank 0" in out
    norms = lambda out: [
        float(x.split("grad norm ")[1]) for x in out.splitlines() if "grad norm" in x
    ]  # noqa: E731
    assert norms(one) == pytest.approx(norms(two), rel=1e-4)


def test_finetune_tiny_hf(tmp_path):
    out = _run(sys.executable, os.path.join(ROOT, "examples", "finetune_tiny_hf.py"),
               "--iters", "4", "--dir", str(tmp_path))  # fmt: skip
    assert "iteration 4/4" in out and f"exported model in {tmp_path / 'out'}:" in out
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "4\n"
