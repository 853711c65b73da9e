"""Smoke tests: every bench runs end to end at tiny sizes and prints its table."""

import json
import os
import subprocess
import sys

import pytest
from helpers import HANG_TIMEOUT, ROOT

BENCH = os.path.join(ROOT, "bench")

# Every test here runs a bench script in a subprocess (or reads what one wrote).
pytestmark = pytest.mark.slow


def run_bench(script, *args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    res = subprocess.run(
        [sys.executable, os.path.join(BENCH, script), *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout


@pytest.fixture(scope="module")
def e2e_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "e2e.json"
    stdout = run_bench(
        "bench_e2e.py",
        "--layers",
        1,
        "--hidden",
        32,
        "--heads",
        2,
        "--seq",
        16,
        "--vocab",
        64,
        "--micro-batch",
        1,
        "--iters",
        3,
        "--warmup",
        1,
        "--repeats",
        1,
        "--pair-iters",
        4,
        "--configs",
        "ddp,offload",
        "--json",
        out,
    )
    return stdout, json.loads(out.read_text())


def test_bench_e2e_tiny(e2e_report):
    stdout, rep = e2e_report
    assert "=== part 1: end-to-end, CPU" in stdout
    assert "tokens/s" in stdout and "vs DDP" in stdout
    assert "part 1: (a)/(b) tokens/s" in stdout and "part 2: (a)/(b) tokens/s" in stdout
    assert "where the time goes" in stdout and "Adam (C++ CPU Adam" in stdout
    assert set(rep["configs"]) == {"ddp", "offload"}
    assert rep["configs"]["ddp"]["vs_ddp"] == pytest.approx(1.0)
    for c in rep["configs"].values():
        assert c["tokens_per_sec"] > 0 and len(c["samples_ms"][0]) == 2  # 3 iterations - 1
    assert rep["pair"]["pairs"] == 3 and rep["pair"]["ratio_median"] > 0
    # the same model on the same data: the baseline and ours train identically (fp32)
    assert rep["final_loss"]["offload"] == pytest.approx(rep["final_loss"]["ddp"], rel=1e-4)
    loss = rep["pair"]["final_loss"]
    assert loss["offload"] == pytest.approx(loss["ddp"], rel=1e-4)


def test_bench_traffic_tiny(tmp_path):
    out = tmp_path / "traffic.json"
    stdout = run_bench(
        "bench_traffic.py",
        "--precisions",
        "bf16,fp32",
        "--micro",
        "1,2",
        "--dp",
        "1",
        "--iters",
        2,
        "--json",
        out,
    )
    assert "=== host<->device bytes per parameter per iteration" in stdout
    assert "paper min" in stdout and "DeepSpeed" in stdout
    rows = json.loads(out.read_text())["rows"]
    got = {(r["precision"], r["micro_batches"]): r["total"] for r in rows}
    # our step: k compute-dtype gradient copies down + one parameter copy up
    assert got == pytest.approx(
        {("bf16", 1): 4.0, ("bf16", 2): 6.0, ("fp32", 1): 8.0, ("fp32", 2): 12.0}
    )


def test_bench_cpu_adam_tiny(tmp_path):
    out = tmp_path / "adam.json"
    stdout = run_bench(
        "bench_cpu_adam.py",
        "--sizes",
        "2e4",
        "--repeats",
        1,
        "--threads",
        1,
        "--no-deepspeed",
        "--json",
        out,
    )
    assert "Mparams/s" in stdout and "stream_probe" in stdout
    assert json.loads(out.read_text())["sizes"]


def test_plots(tmp_path, e2e_report):
    pytest.importorskip("matplotlib")  # genuinely optional: the next test covers its absence
    sys.path.insert(0, BENCH)
    try:
        from plot_results import plot_e2e
    finally:
        sys.path.remove(BENCH)
    png = tmp_path / "e2e.png"
    assert plot_e2e(e2e_report[1], str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_without_matplotlib(tmp_path, e2e_report):
    src = tmp_path / "e2e.json"
    src.write_text(json.dumps(e2e_report[1]))
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.path.insert(0, sys.argv[1]);"
        "import plot_results; sys.exit(plot_results.main(['e2e', sys.argv[2], sys.argv[3]]))"
    )
    png = tmp_path / "none.png"
    res = subprocess.run(
        [sys.executable, "-c", code, BENCH, str(src), str(png)],
        capture_output=True,
        text=True,
        timeout=HANG_TIMEOUT,
    )
    assert res.returncode == 0, res.stderr
    assert "matplotlib is not installed" in res.stdout
    assert not png.exists()


def test_bench_overlap_tiny(tmp_path):
    """Both runs through train_step, paired; bitwise the same losses; the model's
    prediction beside the measured ratio; the required last line."""
    out = tmp_path / "overlap.json"
    stdout = run_bench(
        "bench_overlap.py",
        *("--layers", 1, "--hidden", 64, "--seq", 8, "--vocab", 64),
        *("--iters", 3, "--warmup", 1, "--json", out),
    )
    lines = stdout.strip().splitlines()
    assert lines[-1].startswith("paired step-time ratio (overlap / sync): ")
    r = float(lines[-1].rsplit(" ", 1)[1])
    assert "losses bitwise equal: True (4 iterations each)" in stdout
    assert "throughput model on these phases: overlapped step" in stdout
    rep = json.loads(out.read_text())
    assert len(rep["ratios"]) == 3 and rep["ratio"] == pytest.approx(r, abs=6e-4)
    assert rep["equal"] is True and 0 < rep["predicted"] and 0 < rep["bound"] < 1
    assert all(row["replayed"] == 0 for row in rep["overlap"])  # no clipping: all commit
    assert all(row["worker"] > 0 and "adam" not in row for row in rep["overlap"])
    assert all(row["adam"] > 0 and row["upload"] > 0 for row in rep["sync"])


def test_bench_contention_tiny(tmp_path):
    """The main job, quiet then beside a CPU-bound process, in one run: both medians,
    the ratio as the last line, and no CPU-bound process left behind."""
    out = tmp_path / "contention.json"
    stdout = run_bench(
        "bench_contention.py",
        *("--iters", 3, "--warmup", 1, "--hogs", 1, "--nproc", 1, "--tp", 1, "--json", out),
        timeout=900,
    )
    lines = stdout.strip().splitlines()
    assert lines[-1].startswith("contention ratio (loaded / quiet): ")
    rep = json.loads(out.read_text())
    assert [r["kind"] for r in rep["runs"]] == ["quiet", "loaded"]
    assert rep["quiet_median_s"] > 0 and rep["loaded_median_s"] > 0
    assert float(lines[-1].rsplit(" ", 1)[1]) == pytest.approx(rep["ratio"], abs=6e-3)
    hogs = subprocess.run(["pgrep", "-f", "x \\+= i \\* i"], capture_output=True, text=True)
    assert hogs.stdout == "", "a CPU-bound process outlived the bench"


def test_bench_planner_cli_tiny():
    out = run_bench("bench_planner_cli.py", "--repeats", 1, "--only", "7B")
    lines = out.splitlines()
    assert lines[1].split()[:2] == ["question", "this"]
    assert lines[2].startswith("one H200, 7B, global batch 4") and float(lines[2].split()[-1]) > 0


def test_bench_any_model_tiny(tmp_path):
    """A tiny Llama in the user loop, both optimizers paired: the ratio, the bytes per
    parameter (torch: weights, grads, two moments in fp32 = 16; ours: bf16 weights and
    buckets, the rest on the host), and the same model learning alike on both sides."""
    out = tmp_path / "any.json"
    stdout = run_bench(
        "bench_any_model.py",
        *("--hidden", 32, "--layers", 1, "--heads", 2, "--ffn", 64, "--vocab", 128),
        *("--seq", 16, "--pairs", 2, "--warmup", 1, "--threads", 1, "--json", out),
    )
    assert "step-time ratio OffloadAdamW / AdamW(fused): median" in stdout
    assert "| OffloadAdamW(dtype=torch.bfloat16) |" in stdout
    rep = json.loads(out.read_text())
    assert rep["ratio_median"] > 0 and len(rep["ratios"]) == 2
    assert rep["device_bytes_per_param"]["torch"] == pytest.approx(16.0)
    # bf16 weights in one flat buffer (bucket alignment pads it by a little)
    assert 2 * rep["params"] <= rep["ours_bytes"]["device"]["params"] < 2.1 * rep["params"]
    assert rep["device_bytes_per_param"]["ours"] < 4.1
    assert rep["losses"]["ours"] == pytest.approx(rep["losses"]["torch"], rel=0.02)


def test_bench_host_sums_prints_each_k_and_the_wait():
    out = run_bench("bench_host_sums.py", "--micro-batches", "1,2", "--steps", 1,
                    "--layers", 1, "--hidden", 64, "--seq", 16)  # fmt: skip
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [r[0] for r in rows] == ["1", "2"], out
    assert all(float(r[1]) >= float(r[2]) > 0.0 and float(r[3]) >= 0.0 for r in rows), out


def test_bench_save_memory_prints_a_row_per_form():
    """A tiny model, both stored forms: each row has the peak without and with the save,
    their difference, and the ratio to the state (which can be negative: noise)."""
    out = run_bench("bench_save_memory.py", "--fractions", 1, "--forms", "fp32,compact",
                    "--iters", 1, "--layers", 1, "--hidden", 64, "--vocab", 256,
                    timeout=900)  # fmt: skip
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [r[:2] for r in rows] == [["1", "fp32"], ["1", "compact"]], out
    for r in rows:
        base, saved, delta = float(r[2]), float(r[3]), float(r[4])
        assert base > 0 and saved > 0 and delta == pytest.approx(saved - base, abs=0.11)
