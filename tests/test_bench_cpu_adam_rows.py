"""bench/bench_cpu_adam.py's row logic (bench/cpu_adam_rows.py): --rows, the rounds a
class is timed in, the memory a run needs and the refusal naming --sizes."""

import json
import os
import subprocess
import sys

import pytest
from helpers import HANG_TIMEOUT, ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import cpu_adam_rows as cr  # noqa: E402

sys.path.remove(os.path.join(ROOT, "bench"))
BENCH = os.path.join(ROOT, "bench", "bench_cpu_adam.py")
ORDER = [
    "fp32",
    "fp32+bf16out",
    "bf16grad",
    "bf16mom",
    "bf16g+out",
    "rem",
    "bf16g+bf16mom+out",
    "rem+bf16mom",
    "q8mom",
    "rem+q8mom",
]


def keys(rows):
    return [r.key for r in rows]


def test_select_by_number_or_name_in_catalogue_order():
    assert keys(cr.select("18,ours_rem,14, 17")) == [
        "ours_rem",
        "ours_rem_bf16mom",
        "ours_q8mom",
        "ours_rem_q8mom",
    ]
    assert keys(cr.select(None)) == keys(cr.select("all")) == keys(cr.ROWS)
    assert "deepspeed" not in keys(cr.select("all", drop=("deepspeed",)))
    for bad in ("15", "ours_fp64", "1,,2"):
        with pytest.raises(ValueError, match=r"^--rows: no row"):
            cr.select(bad)


def test_every_row_has_a_class_and_declared_buffers():
    assert len({r.num for r in cr.ROWS}) == len(cr.ROWS)
    for r in cr.ROWS:
        assert r.traffic in ORDER and set(r.buffers) <= set(cr.BUFFERS), r
    for _, num, den, _, _ in cr.CHECKS:
        assert den in cr.BY_KEY and (num == cr.CEIL or num in cr.BY_KEY)


def test_rounds_take_partners_and_the_reference_only_when_selected():
    alone = cr.rounds(cr.select("12,14,17,18"), ORDER)
    assert [(c, keys(m)) for c, m in alone] == [
        ("rem", ["ours_rem"]),
        ("rem+bf16mom", ["ours_rem_bf16mom"]),
        ("q8mom", ["ours_q8mom"]),
        ("rem+q8mom", ["ours_rem_q8mom"]),
    ]
    # today's step is the partner the remainder check compares with, in the rem round;
    # torch fused is timed in every round (the paired "vs fused")
    both = dict(cr.rounds(cr.select("7,11,12"), ORDER))
    assert keys(both["rem"]) == ["ours_rem", "ours_bf16g_out", "torch_fused"]
    assert keys(both["bf16g+out"]) == ["ours_bf16g_out", "torch_fused"]
    assert keys(both["fp32"]) == ["torch_fused"]
    names = [c[0] for c in cr.checks_for(cr.select("7,11,12"))]
    assert names == [
        "remainders within 10% of ceiling (26 B)",
        "remainders at <= 0.95x today's bf16 step (t_today / t_rem)",
    ]


def test_bytes_needed_is_the_reference_plus_the_largest_round():
    ceiling = {c: (10, "gbf") for c in ORDER} | {"fp32": (12, "g32")}
    need = cr.bytes_needed(cr.select("12,18"), 1000, ceiling)
    # rem: hi, lo, fp32 moments (12) + bf16 grads (2) + scratch 10
    total = cr.HEADROOM * 24_000 + cr.BASE
    assert need == {"total": total, "persistent": 0, "largest": ("rem", 24_000)}
    need = cr.bytes_needed(cr.select("1,6,7,19"), 1000, ceiling)
    # fp32: state 12 + g32 4 + dst 12 + scratch 12 = 40; torch's 16 kept throughout
    assert need["persistent"] == 16_000 and need["largest"] == ("fp32", 40_000)
    assert need["total"] == pytest.approx(cr.HEADROOM * 56_000 + cr.BASE)


def test_refusal_names_sizes_only_when_over_the_available_share():
    need = {"total": 95e9, "persistent": 5e9, "largest": ("fp32", 90e9)}
    assert cr.refusal(need, int(5e8), int(200e9)) is None
    assert cr.refusal(need, int(5e8), None) is None  # unknown: nothing refused
    msg = cr.refusal(need, int(5e8), int(100e9))
    assert msg.startswith("--sizes 5e8: the rows chosen need about 95.0 GB")
    assert "MemAvailable" in msg and "\n" not in msg


def _bench(*args, timeout=HANG_TIMEOUT):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, BENCH, "--threads", "1", "--no-deepspeed", *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_bench_refuses_before_allocating_and_rejects_a_bad_row():
    res = _bench("--sizes", "1e12")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("bench_cpu_adam: error: --sizes 1e12: the rows chosen need")
    res = _bench("--rows", "1,nope")
    assert res.returncode == 2 and "--rows: no row 'nope'" in res.stderr


def test_the_makers_allocate_what_the_catalogue_declares():
    code = (
        "import sys; sys.argv = ['b', '--threads', '1'];"
        "import bench_cpu_adam as b; P = b.Pool(1000, parent=b.Pool(1000));"
        "[P[k] for k in b.MAKERS if k != 'deepspeed']; print(sorted(P.made))"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, ROOT + "/bench"]))
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT
    )
    assert res.returncode == 0, res.stderr[-2000:]  # Pool asserts each buffer's bytes
    assert "torch_ref" not in res.stdout  # a persistent buffer lives in the parent pool


@pytest.mark.slow
def test_rows_run_alone(tmp_path):
    out = tmp_path / "rows.json"
    res = _bench("--sizes", "2e4", "--repeats", 2, "--rows", "1,6", "--json", out)
    assert res.returncode == 0, res.stderr[-2000:]
    size = json.loads(out.read_text())["sizes"]["20000"]
    assert [r["key"] for r in size["rows"]] == ["ours_fp32", "ours_decay_runs", "ceiling_fp32"]
    assert list(size["ceiling"]) == ["fp32"]
    assert [c["name"] for c in size["checks"]] == [
        "decay_runs within 3% of one decay (1.03 * t_fp32 / t_runs)",
        "ours fp32 within 10% of ceiling (t_ceiling / t_ours)",
    ]
    assert all(r["vs_torch_fused"] is None for r in size["rows"])  # torch fused not chosen
