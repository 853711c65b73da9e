"""planner/cli.py: the dry run, the plan command line, presets and flags."""

import os
import subprocess
import sys
import time

import pytest
from helpers import ROOT
from planner_cases import TEN_B, plan_out

from mp_offload.planner.throughput import Machine


@pytest.mark.slow
def test_dry_run_prints_the_plan_without_allocating():
    env = dict(
        os.environ,
        PLAN_DEVICE_MEMORY_GB="80",
        PLAN_HOST_MEMORY_GB="2048",
        PLAN_DEVICES_PER_NODE="8",
        OMP_NUM_THREADS="1",
    )
    argv = [
        "pretrain_gpt.py",
        *TEN_B,
        "--dry-run",
        "--world-size",
        "8",
        "--tensor-model-parallel-size",
        "2",
    ]
    # Run pretrain_gpt.py as __main__ and report this process's own peak RSS at exit.
    wrapper = (
        "import resource, runpy, sys\n"
        f"sys.argv = {argv!r}\n"
        "try:\n    runpy.run_path('pretrain_gpt.py', run_name='__main__')\n"
        "finally:\n    print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF)"
        ".ru_maxrss, file=sys.stderr)\n"
    )
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-c", wrapper],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    elapsed = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "parameters 10,27" in out and "FLOPs per token" in out
    assert "TP rank(s) 0..1 x DP ranks 0..3 (8 of 8 ranks)" in out  # every rank kind
    assert "-> fits" in out and "zero2" in out and "pytorch" in out
    # A 10B model in fp32 would need ~41 GB; the meta build needs next to nothing.
    peak_gb = int(res.stderr.split("MAXRSS_KB")[1].split()[0]) / 2**20
    assert peak_gb < 2.0, f"dry run used {peak_gb:.1f} GB"
    assert elapsed < 60, f"dry run took {elapsed:.0f}s"


def test_plan_cli(capsys):
    from mp_offload.plan import main

    assert (
        main(
            [
                *TEN_B,
                "--device-memory-gb",
                "32",
                "--host-memory-gb",
                "1536",
                "--max-model",
                "--family",
                "layers",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "max model (layers)" in out and "--num-layers" in out
    assert main([*TEN_B, "--json", "--world-size", "4", "--tensor-model-parallel-size", "2"]) == 0
    import json

    rec = json.loads(capsys.readouterr().out)
    assert rec["tp"] == 2 and rec["dp"] == 2 and rec["fits"] is True
    assert main(["--tensor-model-parallel-size", "3", "--world-size", "4"]) == 2


def test_plan_cli_llama_presets(capsys):
    """``--model NAME`` starts from a published shape; flags given after it still win."""
    import json

    from mp_offload.plan import main

    dgx2 = ["--device-memory-gb", "32", "--host-memory-gb", "1536", "--devices-per-node", "16"]
    run = [
        "--world-size",
        "16",
        "--tensor-model-parallel-size",
        "8",
        "--fp16",
        "--cpu-offload",
        "--recompute-activations",
        "--micro-batch-size",
        "2",
        *dgx2,
        "--json",
    ]
    assert main(["--model", "llama2-70b", *run]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["parameters"] == 68_989_231_104 and plain["fits"]
    assert main(["--model", "llama2-70b", *run, "--sequence-parallel"]) == 0
    sp = json.loads(capsys.readouterr().out)
    assert sp["device"]["activations"] < plain["device"]["activations"] / 4
    assert main(["--model", "llama3-8b", "--num-layers", "2", "--seq-length", "2048"]) == 0
    out = capsys.readouterr().out
    assert "GPT 2 layers x hidden 4096" in out and "seq 2048" in out and "GQA 8 groups" in out
    assert (
        main(["--model", "llama2-70b", "--world-size", "16", "--tensor-model-parallel-size", "16"])
        == 2
    )  # 8 K/V groups over 16 ranks
    assert "--num-query-groups 8 is not divisible" in capsys.readouterr().err


def test_flags_replace_the_assumed_defaults(capsys, monkeypatch):
    code, out = plan_out(
        capsys,
        monkeypatch,
        "--fp32",
        "--no-cpu-offload",
        "--no-recompute-activations",
        "--seq-length",
        "256",
        "--vocab-size",
        "4096",
    )
    assert code == 0
    assert out.startswith("planning fp32, ZeRO-2, no offload, recompute off, seq 256")
    assert "assumed" not in out.splitlines()[0]
    for bad in (
        ["--fp32", "--bf16"],
        ["--no-cpu-offload", "--cpu-offload"],
        ["--recompute-activations", "--no-recompute-activations"],
    ):
        code, _ = plan_out(capsys, monkeypatch, *bad)
        assert code == 2
    # A model given: its plan, then its time and launch command.
    code, out = plan_out(
        capsys, monkeypatch, *TEN_B, "--device-memory-gb", "32", "--host-memory-gb", "1536"
    )
    assert code == 0 and "assumed" not in out.splitlines()[0]
    assert "-> fits" in out and "days per 1B tokens" in out
    assert "--num-layers 50 --hidden-size 4096 --num-attention-heads 32" in out
    assert "--seq-length 1024" in out


def test_machine_preset_sets_the_hardware_and_a_flag_still_wins(capsys):
    from mp_offload.planner.cli import parse

    _, opt = parse(["--machine", "hgx-h200"])
    assert (opt.device_memory_gb, opt.device_tflops, opt.devices_per_node) == (139.8, 400, 8)
    _, opt = parse(["--machine", "hgx-h200", "--device-tflops", "300"])
    assert opt.device_tflops == 300 and opt.device_memory_gb == 139.8
    _, opt = parse([])
    assert opt.device_tflops == Machine.device_tflops  # no preset: the paper's DGX-2


def test_python_m_planner_runs_the_planner():
    """``python -m mp_offload.planner`` is the planner's command line, as ``mp_offload.plan``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [
        *TEN_B,
        "--device-memory-gb",
        "139",
        "--host-memory-gb",
        "128",
        "--devices-per-node",
        "1",
    ]
    outs = [
        subprocess.run(
            [sys.executable, "-m", module, *argv, "--adam-rate-per-core", "8e7"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=ROOT,
        )
        for module in ("mp_offload.planner", "mp_offload.plan")
    ]
    assert outs[0].returncode == 0, outs[0].stderr[-2000:]
    assert "device: " in outs[0].stdout and outs[0].stdout == outs[1].stdout
