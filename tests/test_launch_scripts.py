"""The launch scripts' shell helpers (scripts/common.sh)."""
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("visible,expected", [(None, "4"), ("1,2", "2"), ("", "0"),
                                              ("0,1,2,3,4,5", "4"), ("3,-1,2", "1")])
def test_gpus_here_respects_cuda_visible_devices(tmp_path, visible, expected):
    fake = tmp_path / "nvidia-smi"  # a 4-GPU machine
    fake.write_text("#!/bin/sh\nfor i in 0 1 2 3; do echo \"GPU $i: H200 (UUID: x)\"; done\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    out = subprocess.run(["bash", "-c", f"source {ROOT}/scripts/common.sh; gpus_here"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected
