"""The launch scripts' shell helpers (scripts/common.sh)."""
import dataclasses
import os
import shlex
import subprocess
import sys

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


@pytest.mark.slow
@pytest.mark.parametrize("script,preset,params,fits", [
    ("pretrain_llama3_8b_1gpu_offload.sh", "llama3-8b", "8,030,261,248",
     ("device: 29.83 of 80 GiB -> fits", "host per node: 151.58 of 256 GiB")),
    ("pretrain_llama2_70b_dgx2.sh", "llama2-70b", "68,989,231,104",
     ("device: 19.08 of 32 GiB -> fits", "host per node: 1317.20 of 1536 GiB")),
])
def test_llama_recipes_dry_run(tmp_path, script, preset, params, fits):
    """DRY_RUN=1 prints the plan of every rank kind and the torchrun command; the
    command's model is the planner's ``--model`` preset of the same name."""
    from mp_offload.config import parse_args
    from mp_offload.planner.cli import MODEL_PRESETS
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAN_")}
    env.update(DRY_RUN="1", MOCK_DATA="1", SAVE_DIR=str(tmp_path / "ck"), PYTHON=sys.executable,
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    res = subprocess.run(["bash", os.path.join(ROOT, "scripts", script)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert f"parameters {params}" in out and all(f in out for f in fits), out[-3000:]
    assert not (tmp_path / "ck").exists(), "a dry run creates nothing"
    command = shlex.split(out.split("== command ==")[1].strip().splitlines()[0])
    ours = parse_args(command[command.index("pretrain_gpt.py") + 1:]).model
    # The preset is the shape; recomputation and sequence parallelism are the run's choice.
    run_choices = dict(recompute_activations=False, sequence_parallel=False)
    assert dataclasses.replace(ours, **run_choices) == parse_args(MODEL_PRESETS[preset]).model
