"""The planner chooses the layout (TP, DP, F), answers "how long for N tokens", names the
GPU its speed is priced for, and plans the device memory the GPU really reports."""

import math
import re
from types import SimpleNamespace

import pytest

from mp_offload.model.gpt import num_parameters
from mp_offload.planner.memory import GiB

RATE = ["--adam-rate-per-core", "8e7"]  # the rate the tests' own counts use
H100_REPORTED = 85_520_809_984  # bytes, torch.cuda.get_device_properties().total_memory


def _plan(capsys, monkeypatch, *argv):
    from mp_offload.plan import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main([*RATE, *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _layout_rows(out: str) -> list[dict]:
    """The layout table: one dict per row, the chosen one marked."""
    rows = []
    for line in out.splitlines():
        m = re.match(
            r"  ([* ]) +(\d+)x(\d+) +(\S+) +([\d.]+) +([\d.]+) +(\d+) +([\d.]+) +([\d,]+)$", line
        )
        if m:
            rows.append(
                dict(
                    best=m[1] == "*",
                    tp=int(m[2]),
                    dp=int(m[3]),
                    device=float(m[5]),
                    host=float(m[6]),
                    batch=int(m[7]),
                    step=float(m[8]),
                    tokens_s=int(m[9].replace(",", "")),
                )
            )
    return rows


@pytest.fixture(scope="module")
def hgx_70b():
    """The issue's Must show: --machine hgx-h100 --model llama2-70b --train-tokens 1e10."""
    import contextlib
    import io

    from mp_offload.plan import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(
            [*RATE, "--machine", "hgx-h100", "--model", "llama2-70b", "--train-tokens", "1e10"]
        )
    return code, buf.getvalue()


def test_hgx_h100_llama2_70b_chooses_a_layout_that_fits(hgx_70b):
    code, out = hgx_70b
    assert code == 0
    rows = _layout_rows(out)
    assert rows and rows[0]["best"] and sum(r["best"] for r in rows) == 1
    best = rows[0]
    assert best["tp"] * best["dp"] == 8 and best["tp"] > 1  # TP=1 cannot hold 70B
    # best first: the most tokens per second, then the least host memory
    assert [r["tokens_s"] for r in rows] == sorted((r["tokens_s"] for r in rows), reverse=True)
    assert "not TP=1: does not fit: device" in out
    assert f"TP={best['tp']} x DP={best['dp']}" in out
    assert "DOES NOT FIT" not in out
    verdict = re.search(r"device: ([\d.]+) of ([\d.]+) GiB.* -> fits; host per node.* -> fits", out)
    assert verdict and float(verdict[2]) == 79.64  # what an H100 80GB reports, not 80
    launch = out[out.index("torchrun") :]
    assert launch.startswith("torchrun --standalone --nproc-per-node 8 pretrain_gpt.py")
    assert f"--tensor-model-parallel-size {best['tp']}" in launch
    assert f"--global-batch-size {best['batch']}" in launch
    # the wall time: iterations of the chosen layout's step, for 1e10 tokens
    iters = math.ceil(1e10 / (best["batch"] * 4096))
    wall = re.search(r"wall time for 10,000,000,000 tokens: ([\d,]+) iterations x ([\d.]+) s", out)
    assert wall and int(wall[1].replace(",", "")) == iters and float(wall[2]) == best["step"]
    assert "priced for --machine hgx-h100: 8x H100-80GB SXM (HGX H100)" in out
    assert f"--train-iters {iters} " in launch


def test_hgx_h100_llama2_70b_keeps_the_device_below_97_percent(hgx_70b):
    _, out = hgx_70b
    peak = float(re.search(r"device: ([\d.]+) of", out)[1])
    assert peak * GiB < 0.97 * H100_REPORTED
    assert all(r["device"] * GiB < 0.97 * H100_REPORTED for r in _layout_rows(out))


def test_best_first_is_the_one_definition_of_best():
    from mp_offload.planner.parallel_layout import Layout, best_first

    def lay(tp, tokens, step, host, device):
        return Layout(
            run=SimpleNamespace(tp=tp, options=SimpleNamespace(overlap_cpu_optimizer=False)),
            plan=SimpleNamespace(host_node_peak=host, device_peak=device),
            speed=SimpleNamespace(tokens_per_step=tokens, step_sync=step),
            batch_per_rank=1,
        )

    slow = lay(1, 100, 2.0, 1, 1)  # 50 tokens/s
    fast = lay(8, 100, 1.0, 9, 9)  # 100 tokens/s: first although its step holds fewer
    lean = lay(4, 400, 4.0, 5, 9)  # 100 tokens/s, less host: before ``fast``
    assert best_first([slow, fast, lean]) == [lean, fast, slow]
    tie = lay(2, 400, 4.0, 5, 1)  # and less device memory still
    assert best_first([lean, tie])[0] is tie


def test_tp_choices_divide_heads_and_kv_groups_within_a_node():
    from mp_offload.planner.cli import parse
    from mp_offload.planner.parallel_layout import tp_choices

    args, _ = parse(["--model", "llama2-70b"])
    why = tp_choices(args, 16, 8)
    assert [tp for tp, w in why.items() if not w] == [1, 2, 4, 8]
    assert why[16] == "TP=16 spans nodes of 8"
    why = tp_choices(args, 16, 16)  # a node of 16: 8 K/V groups do not split 16 ways
    assert "--num-query-groups 8 is not divisible" in why[16]
    args, _ = parse(["--model", "gpt2-xl"])  # 25 heads
    why = tp_choices(args, 8, 8)
    assert why[1] == "" and all("--num-attention-heads 25" in why[t] for t in (2, 4, 8))


def test_given_tp_pins_the_layout(capsys, monkeypatch):
    code, out, _ = _plan(
        capsys,
        monkeypatch,
        *["--machine", "hgx-h100", "--model", "llama2-70b"],
        *["--tensor-model-parallel-size", "8"],
    )
    assert code == 0 and "layouts on" not in out and "TP=8 x DP=1" in out


def test_given_global_batch_is_kept_by_every_layout(capsys, monkeypatch):
    code, out, _ = _plan(
        capsys,
        monkeypatch,
        *["--machine", "hgx-h100", "--model", "llama2-7b", "--global-batch-size", "64"],
        *["--train-iters", "1000"],
    )
    assert code == 0
    rows = _layout_rows(out)
    assert len(rows) >= 2 and {r["batch"] for r in rows} == {64}
    assert "--global-batch-size 64" in out
    # --train-iters says how many tokens: 1000 x 64 x 4096
    assert f"wall time for {1000 * 64 * 4096:,} tokens: 1,000 iterations" in out


def test_train_tokens_is_checked(capsys, monkeypatch):
    for bad, says in (
        (["--train-tokens", "0"], "--train-tokens must be > 0"),
        (["--train-tokens", "1e9", "--train-iters", "5"], "--train-tokens excludes"),
    ):
        code, _, err = _plan(capsys, monkeypatch, "--model", "gpt2", *bad)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1


def test_without_a_machine_the_output_names_the_gpu_assumed(capsys, monkeypatch):
    code, out, _ = _plan(capsys, monkeypatch, "--model", "llama2-7b", "--train-tokens", "2e9")
    assert code == 0
    assert "wall time for 2,000,000,000 tokens" in out
    assert "priced for the paper's DGX-2 V100s (no --machine given" in out


# Published parameter counts (the HF checkpoints' totals), vocabulary unpadded.
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_presets_have_the_published_sizes(name):
    from mp_offload.planner.cli import parse

    args, _ = parse(["--model", name, "--make-vocab-size-divisible-by", "1"])
    assert num_parameters(args.model, 1) == PUBLISHED[name]


def test_machine_presets_plan_the_memory_the_device_reports():
    from mp_offload.planner.cli import parse
    from mp_offload.planner.named_models import (
        GPU_MEMORY_MIB,
        MACHINE_GPUS,
        MACHINE_PRESETS,
        device_memory_gib,
    )

    _, opt = parse(["--machine", "hgx-h100"])
    assert opt.device_memory_gb == 79.64 and opt.device_memory_gb * GiB <= H100_REPORTED
    assert set(MACHINE_GPUS) == set(MACHINE_PRESETS)
    for gpu, mib in GPU_MEMORY_MIB.items():
        assert mib * 2**20 - 0.01 * GiB < device_memory_gib(gpu) * GiB <= mib * 2**20
        marketed = int(re.search(r"(\d+)GB", gpu)[1])
        assert device_memory_gib(gpu) < marketed  # never the marketing figure
    reported = {device_memory_gib(g) for g in GPU_MEMORY_MIB}
    for name in MACHINE_PRESETS:
        _, opt = parse(["--machine", name])
        assert opt.device_memory_gb in reported, name


def test_paper_table_targets_plan_the_reported_memory():
    from mp_offload.planner.search import paper_rows

    sizes = {row.hw.name: row.hw.device_memory_gb for row in paper_rows()}
    assert sizes["1x 80GB GPU, 256 GiB host"] == sizes["8x 80GB GPU node, 2 TiB host"] == 79.64
    assert sizes["1x H200-141GB, 256 GiB host"] == 139.8
    assert sizes["DGX-2: 16x V100-32GB, 1.5 TB host"] == 31.74


def test_help_is_grouped_and_every_planner_flag_has_help(capsys):
    from mp_offload.planner.arguments import _planner_parser

    p = _planner_parser()
    text = p.format_help()
    for title in ("planner: hardware", "planner: what to plan", "planner: speed model"):
        assert f"\n{title}:" in text
    planner = [a for a in p._actions if a.dest.startswith("plan.")]
    assert planner and all(a.help for a in planner), [a.dest for a in planner if not a.help]
    assert "--train-tokens" in text and "--num-layers" in text and "--lr-decay-style" not in text
    assert len(text.splitlines()) < 200


def test_no_layout_fits_retries_with_the_savers_then_shows_the_nearest_miss(capsys, monkeypatch):
    code, out, _ = _plan(
        capsys,
        monkeypatch,
        *["--machine", "rtx4090", "--model", "llama2-13b", "--world-size", "2"],
        *["--devices-per-node", "2", "--host-memory-gb", "128"],
    )
    assert code == 0 and _layout_rows(out) == []
    asked, retried = out.split("nothing fits as asked: the layouts with ")
    assert "not TP=1: does not fit: device short" in asked and "not TP=2: does not fit" in asked
    assert retried.startswith("--micro-batch-size 1 --sequence-parallel\n")
    miss = re.search(
        r"no layout fits 2 GPU\(s\) even so; the nearest miss \(the highest TP\), "
        r"TP=2 x DP=1: host short ([\d.]+) GiB per node \(([\d.]+) of ([\d.]+) usable\)",
        retried,
    )
    assert miss and float(miss[1]) == pytest.approx(float(miss[2]) - float(miss[3]), abs=0.02)
    assert "micro-batch 1, TP=2 x DP=1" in retried  # the plan shown is the nearest miss's
    assert "DOES NOT FIT" in retried and "torchrun" not in out


def test_dgx2_llama2_70b_plans_as_the_shipped_script_runs_it(capsys, monkeypatch):
    """scripts/pretrain_llama2_70b_dgx2.sh: TP=8 x DP=2, sequence parallel, fp16 (V100s)."""
    code, out, _ = _plan(capsys, monkeypatch, "--machine", "dgx2", "--model", "llama2-70b")
    assert code == 0
    rows = _layout_rows(out)
    assert rows and rows[0]["best"] and (rows[0]["tp"], rows[0]["dp"]) == (8, 2)
    assert "turned on to fit: --micro-batch-size 1 --sequence-parallel\n" in out
    assert out.count("planning fp16,") == 1 and "micro-batch 1, TP=8 x DP=2" in out
    plan = out[out.index("plan: mode offload") :]
    assert "DOES NOT FIT" not in plan.split("same model")[0]
    launch = out[out.index("torchrun") :]
    for flag in (
        "--tensor-model-parallel-size 8",
        "--micro-batch-size 1",
        "--sequence-parallel",
        "--fp16",
        "--recompute-activations",
    ):
        assert flag in launch
    assert "--bf16" not in launch


def test_a_single_plan_that_does_not_fit_turns_the_savers_on(capsys, monkeypatch):
    code, out, _ = _plan(
        capsys,
        monkeypatch,
        *["--machine", "h100", "--model", "llama2-7b", "--no-recompute-activations"],
        *["--micro-batch-size", "16"],
    )
    assert code == 0 and "layouts on" not in out
    said = re.search(
        r"turned on to fit: --micro-batch-size 1 --recompute-activations \(as asked it does "
        r"not: device short [\d.]+ GiB per GPU",
        out,
    )
    assert said and "--sequence-parallel" not in out  # TP=1: nothing to split
    assert "micro-batch 1, TP=1 x DP=1" in out and "recompute on" in out
    assert "DOES NOT FIT" not in out.split("same model")[0]
    assert "--micro-batch-size 1 " in out[out.index("torchrun") :]


def test_the_json_plan_is_the_plan_asked_for(capsys, monkeypatch):
    """The device proof holds runs to their --json plan: no saver is turned on there."""
    import json

    code, out, _ = _plan(
        capsys,
        monkeypatch,
        *["--machine", "h100", "--model", "llama2-7b", "--no-recompute-activations"],
        *["--micro-batch-size", "16", "--json"],
    )
    assert code == 0 and json.loads(out)["fits"] is False
