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


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--devices-per-node", "0"], "--devices-per-node must be >= 1, got 0"),
        (["--host-memory-gb", "-5"], "--host-memory-gb must be > 0, got -5"),
        (["--device-memory-gb", "0"], "--device-memory-gb must be > 0, got 0"),
        (["--device-memory-gb", "nan"], "--device-memory-gb must be a finite number"),
        (["--host-memory-gb", "inf"], "--host-memory-gb must be a finite number"),
        (["--host-headroom-gb", "-1"], "--host-headroom-gb must be >= 0"),
        (["--host-headroom-gb", "300"], "--host-headroom-gb 300 leaves nothing"),
        (["--device-memory-reserve-gb", "79.5"], "leave nothing of --device-memory-gb 80"),
        (["--device-reserved-gb", "-1"], "--device-reserved-gb must be >= 0"),
        (["--host-process-gb", "-2"], "--host-process-gb must be >= 0"),
        (["--pcie-gbs", "0"], "--pcie-gbs must be > 0"),
        (["--cpu-cores-per-node", "0"], "--cpu-cores-per-node must be >= 1"),
        (["--adam-rate-per-core", "-1"], "--adam-rate-per-core must be > 0"),
        (["--batch-per-gpu", "0"], "--batch-per-gpu must be >= 1"),
        (["--throughput", "--gpus", "0", "8"], "--gpus must be >= 1, got 0"),
        (["--world-size", "100000000"], "--world-size must be <= 1,048,576"),
    ],
)
def test_every_hardware_flag_is_range_checked(capsys, monkeypatch, flags, says):
    from mp_offload.plan import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main(["--model", "gpt2", "--world-size", "8", *flags])  # the last --world-size wins
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("plan: error: ") and err.count("\n") == 1 and says in err


def test_an_impossible_model_is_answered_before_any_layout(capsys, monkeypatch):
    """~1.2e18 parameters: one line from the parameter count; no bucket layout is made."""
    from mp_offload.optimizer import layout

    def no_layout(*a, **kw):
        raise AssertionError("a bucket layout was made for an impossible model")

    monkeypatch.setattr(layout.FlatLayout, "__init__", no_layout)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    from mp_offload.plan import main

    big = ["--num-layers", "100000", "--hidden-size", "1000000", "--num-attention-heads", "8"]
    code = main([*big, "--machine", "hgx-h100"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("plan: nothing fits: 1,200,001,353,250,000,000 parameters (1.2e+18)")
    assert "at TP=8 (the most on 8 GPU(s), 8 per node)" in err and "usable" in err
    code = main(["--num-layers", "100000"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and err.count("\n") == 1 and "(78.99B)" in err


def test_the_precision_follows_the_machine(capsys, monkeypatch):
    """V100s (the DGX-2) have no bf16: planned in fp16, as its launch scripts run them."""
    code, out = plan_out(capsys, monkeypatch, "--machine", "dgx2", "--model", "gpt2")
    assert code == 0 and out.count("planning fp16,") == 1
    assert "assumed (the launch scripts' defaults; give the flag to change it): --fp16" in out
    launch = out[out.index("torchrun") :]
    assert "--fp16" in launch and "--bf16" not in launch
    code, out = plan_out(capsys, monkeypatch, "--machine", "hgx-h100", "--model", "gpt2")
    assert code == 0 and "planning bf16," in out and "--bf16" in out[out.index("torchrun") :]
    from mp_offload.plan import main

    assert main(["--machine", "dgx2", "--model", "gpt2", "--bf16"]) == 2
    err = capsys.readouterr().err
    assert err == "plan: error: --bf16: --machine dgx2's V100s have no bf16; plan --fp16\n"


@pytest.mark.parametrize(
    "name, value, says",
    [
        ("PLAN_DEVICES_PER_NODE", "0", "PLAN_DEVICES_PER_NODE must be >= 1, got 0"),
        ("PLAN_HOST_MEMORY_GB", "-5", "PLAN_HOST_MEMORY_GB must be > 0, got -5.0"),
        ("PLAN_HOST_MEMORY_GB", "abc", "PLAN_HOST_MEMORY_GB must be a number, got 'abc'"),
        ("PLAN_DEVICE_MEMORY_GB", "inf", "PLAN_DEVICE_MEMORY_GB must be a finite number"),
        ("PLAN_HOST_HEADROOM_GB", "300", "PLAN_HOST_HEADROOM_GB must be >= 0 and < 256"),
        ("LOCAL_WORLD_SIZE", "two", "LOCAL_WORLD_SIZE must be an integer, got 'two'"),
    ],
)
def test_the_dry_runs_hardware_variables_are_range_checked(monkeypatch, name, value, says):
    from mp_offload.config import ConfigError
    from mp_offload.planner.dry_run import hardware_from_env

    for var in ("PLAN_DEVICE_MEMORY_GB", "PLAN_HOST_MEMORY_GB", "PLAN_DEVICES_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PLAN_HOST_MEMORY_GB", "256")
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        hardware_from_env(8)
    assert str(e.value) == says or str(e.value).startswith(says)


def test_rank_bytes_are_the_dry_runs_totals_without_building_the_model(capsys, monkeypatch):
    """What a memory preflight compares with the machine: one rank's host and device sums,
    from the written-down shapes (no model built), equal to the dry run's meta-built plan."""
    import re

    from mp_offload.config import parse_args, resolve
    from mp_offload.model.gpt import GPTModel
    from mp_offload.planner import dry_run, rank_bytes

    argv = [*TEN_B, "--tensor-model-parallel-size", "2", "--global-batch-size", "16"]
    args = resolve(parse_args([*argv, "--mock-data", "--dry-run", "--world-size", "8"]), 8)
    for var in ("PLAN_DEVICE_MEMORY_GB", "PLAN_HOST_MEMORY_GB", "PLAN_DEVICES_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    dry_run(args, 8)
    out = capsys.readouterr().out
    dev, host = (float(x) for x in re.search(r"    total +([\d.]+) +total +([\d.]+)", out).groups())

    def no_model(*a, **kw):
        raise AssertionError("rank_bytes built the model")

    monkeypatch.setattr(GPTModel, "__init__", no_model)
    host_bytes, device_bytes = rank_bytes(args, 8, cuda=True)
    assert round(host_bytes / 2**30, 2) == host and round(device_bytes / 2**30, 2) == dev
    assert host_bytes > 12 * 10.27e9 / 8  # fp32 master and moments of its eighth at least
