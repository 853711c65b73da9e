"""The launch scripts' shell helpers (scripts/common.sh)."""

import dataclasses
import os
import shlex
import subprocess
import sys

import pytest
from helpers import HANG_TIMEOUT, ROOT


@pytest.mark.parametrize(
    "visible,expected",
    [(None, "4"), ("1,2", "2"), ("", "0"), ("0,1,2,3,4,5", "4"), ("3,-1,2", "1")],
)
def test_gpus_here_respects_cuda_visible_devices(tmp_path, visible, expected):
    fake = tmp_path / "nvidia-smi"  # a 4-GPU machine
    fake.write_text('#!/bin/sh\nfor i in 0 1 2 3; do echo "GPU $i: H200 (UUID: x)"; done\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    out = subprocess.run(
        ["bash", "-c", f"source {ROOT}/scripts/common.sh; gpus_here"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == expected


@pytest.mark.slow
@pytest.mark.parametrize(
    "script,preset,params,fits",
    [
        (
            "pretrain_llama3_8b_1gpu_offload.sh",
            "llama3-8b",
            "8,030,261,248",
            (
                "device: 29.83 of 80 GiB (76.0 usable, 4.0 GiB reserve) -> fits",
                "host per node: 152.55 of 256 GiB",
            ),
        ),
        (
            "pretrain_llama2_70b_dgx2.sh",
            "llama2-70b",
            "68,989,231,104",
            (
                "device: 19.13 of 32 GiB (30.0 usable, 2.0 GiB reserve) -> fits",
                "host per node: 1318.95 of 1536 GiB",
            ),
        ),
    ],
)
def test_llama_recipes_dry_run(tmp_path, script, preset, params, fits):
    """DRY_RUN=1 prints the plan of every rank kind and the torchrun command; the
    command's model is the planner's ``--model`` preset of the same name."""
    from mp_offload.config import parse_args
    from mp_offload.planner.named_models import MODEL_PRESETS

    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAN_")}
    env.update(
        DRY_RUN="1",
        MOCK_DATA="1",
        SAVE_DIR=str(tmp_path / "ck"),
        PYTHON=sys.executable,
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
    )
    res = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert f"parameters {params}" in out and all(f in out for f in fits), out[-3000:]
    assert not (tmp_path / "ck").exists(), "a dry run creates nothing"
    command = shlex.split(out.split("== command ==")[1].strip().splitlines()[0])
    ours = parse_args(command[command.index("pretrain_gpt.py") + 1 :]).model
    # The preset is the shape; recomputation and sequence parallelism are the run's choice.
    run_choices = dict(recompute_activations=False, sequence_parallel=False)
    assert dataclasses.replace(ours, **run_choices) == parse_args(MODEL_PRESETS[preset]).model


def _tiny_dry_run(tmp_path, model):
    env = dict(
        os.environ,
        DRY_RUN="1",
        SKIP_SETUP="1",
        PYTHON=sys.executable,
        MODEL=model,
        RUN_DIR=str(tmp_path / model),
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
    )
    res = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "pretrain_gpt_tiny_cpu.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    command = shlex.split(res.stdout.strip().splitlines()[-1])
    return command[command.index("pretrain_gpt.py") + 1 :]


@pytest.mark.slow
def test_tiny_script_model_llama_adds_the_llama_flags(tmp_path):
    """MODEL=llama: the GPT's command plus every Llama option, in a model of about the
    same parameter count; MODEL=gpt (the default) has none of them."""
    from mp_offload.config import parse_args
    from mp_offload.model.gpt import num_parameters

    gpt, llama = (_tiny_dry_run(tmp_path, m) for m in ("gpt", "llama"))
    flags = [
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--position-embedding-type",
        "rope",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
    ]
    assert all(f in llama for f in flags) and not any(f in gpt for f in flags[2::2])
    m = parse_args(llama).model
    assert (
        m.rms_norm,
        m.swiglu,
        m.rotary,
        m.kv_groups,
        m.untie_embeddings_and_output_weights,
        m.disable_bias_linear,
    ) == (True, True, (10000, 1.0), 2, True, True)
    g = parse_args(gpt).model
    assert (g.num_layers, g.hidden_size) == (m.num_layers, m.hidden_size)
    assert abs(num_parameters(m) / num_parameters(g) - 1) < 0.1
    assert str(tmp_path / "llama") in " ".join(llama)  # its own run directory
    res = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "pretrain_gpt_tiny_cpu.sh")],
        env=dict(os.environ, MODEL="bert"),
        capture_output=True,
        text=True,
        timeout=HANG_TIMEOUT,
    )
    assert res.returncode == 2 and "MODEL must be gpt or llama" in res.stderr


def test_launch_scripts_name_the_thread_flag_not_omp_num_threads():
    """The project ignores OMP_NUM_THREADS on purpose (torchrun sets it to 1), so no launch
    script sets or advises it; the shared header names --cpu-threads-per-rank instead."""
    scripts = os.path.join(ROOT, "scripts")
    names = [n for n in os.listdir(scripts) if n.startswith("pretrain_") or n == "common.sh"]
    for name in names:
        with open(os.path.join(scripts, name)) as f:
            assert "OMP_NUM_THREADS" not in f.read().replace("OMP_NUM_THREADS is ignored", ""), name
    with open(os.path.join(scripts, "common.sh")) as f:
        assert "--cpu-threads-per-rank" in f.read()


# A Python for the tiny script: no GPU, and a job that ends with $RC (stderr: its line).
FAILING_JOB = """#!/bin/bash
case "$1" in
  -c) echo 0 ;;
  *torchrun_quiet.py) echo "pretrain_gpt.py: error: the job's line" >&2; exit "$RC" ;;
esac
"""


@pytest.mark.parametrize(
    "rc,saved,advice",
    [
        (2, False, "correct what the error above names, then run it again"),
        (2, True, "correct what the error above names, then run it again (it resumes from"),
        (1, True, "run the same command again to resume from the latest checkpoint in"),
        (1, False, "no checkpoint was saved in "),
    ],
)
def test_the_tiny_scripts_last_line_advises_resuming_only_from_a_checkpoint(
    tmp_path, rc, saved, advice
):
    fake = tmp_path / "python"
    fake.write_text(FAILING_JOB)
    fake.chmod(0o755)
    run_dir = tmp_path / "run"
    if saved:
        (run_dir / "ckpt").mkdir(parents=True)
        (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").write_text("50\n")
    env = dict(os.environ, PYTHON=str(fake), SKIP_SETUP="1", RUN_DIR=str(run_dir), RC=str(rc))
    res = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "pretrain_gpt_tiny_cpu.sh")],
        env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT,
    )  # fmt: skip
    assert res.returncode == rc
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"pretrain_gpt_tiny_cpu.sh: training stopped (exit {rc}) after ")
    assert advice in last
    assert ("resume" in last) == saved
