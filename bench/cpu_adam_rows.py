"""The rows of bench/bench_cpu_adam.py as data: what each row is, which buffers it
uses, which rows and checks ``--rows`` keeps, and how much memory a run needs (the
bench refuses, naming ``--sizes``, before allocating what would not fit).

No torch and no allocation here (tests import it). The bench times one traffic class
at a time: its rows, the partners its checks compare them with, torch's fused AdamW
(the "vs fused" reference, timed in every class's round when it is selected) and the
class's ceiling patterns are allocated, timed round-robin and freed before the next
class, so a run needs the reference's buffers plus its largest class, not every row's.
"""

from __future__ import annotations

from typing import NamedTuple

Q8_SCALES = 2 * 4 / 256  # two 8-bit moments' fp32 scales, one per 256-element block

# buffer name -> bytes per element, as bench_cpu_adam's makers allocate it (its Pool
# holds every tensor buffer to this number, so the estimate is what gets allocated)
BUFFERS = {
    "g32": 4,
    "gbf": 2,
    "g16": 2,
    "out": 2,
    "state": 12,  # fp32 param, exp_avg, exp_avg_sq
    "state_bf16mom": 8,  # fp32 param, bf16 exp_avg and exp_avg_sq
    "state_q8": 6 + Q8_SCALES,  # fp32 param, two 8-bit moments
    "rem": 12,  # bf16 hi, int16 lo, fp32 moments
    "rem_bf16mom": 8,
    "rem_q8": 6 + Q8_SCALES,
    "dst": 12,  # out of place: fp32 param, exp_avg, exp_avg_sq dsts
    "rem_dst": 12,
    "torch_ref": 16,  # torch's param and grad (fp32), fused AdamW's exp_avg, exp_avg_sq
    "tout": 2,
    "foreach": 8 + 12,  # its exp_avg, exp_avg_sq; ~12 B of temporaries per step
    "deepspeed": 8,
}
# Peak RSS = HEADROOM x the buffers' bytes + BASE (python, torch): the makers' temporaries
# (an fp32 randn before its bf16 copy) and the heap's fragmentation between rounds.
# Measured at 5e7: all rows 4.4-4.6 GB for 3.8 GB of buffers; rows 12,14,17,18 2.19 GB
# for a largest round of 1.3 GB (the estimate: 6.2 and 2.45 GB).
HEADROOM, BASE = 1.5, 0.5e9
PERSISTENT = ("torch_ref",)  # lives for the whole run (the reference of every round)
REFERENCE = "torch_fused"  # timed in every round: the paired "vs fused" column
CEIL = "ceiling"  # a check's numerator: the class's best ceiling pattern
PROBE = "stream_probe"


class Row(NamedTuple):
    num: int
    key: str
    label: str
    traffic: str  # its class: bench_host_ceiling.TRAFFIC (+ the bench's own classes)
    nbytes: int  # bytes the step moves per element
    buffers: tuple[str, ...]


_S, _G = ("state", "g32"), ("state", "gbf")
ROWS = [
    Row(1, "ours_fp32", "ours fp32 grads", "fp32", 28, _S),
    Row(
        2, "ours_fp32_bf16out", "ours fp32 grads + bf16 param_out", "fp32+bf16out", 30, (*_S, "out")
    ),
    Row(3, "ours_bf16g", "ours bf16 grads", "bf16grad", 26, _G),
    Row(4, "ours_fp16g", "ours fp16 grads", "bf16grad", 26, ("state", "g16")),
    Row(
        5, "ours_bf16mom", "ours bf16 exp_avg + exp_avg_sq", "bf16mom", 20, ("state_bf16mom", "g32")
    ),
    Row(6, "ours_decay_runs", "ours fp32, decay_runs (200 runs)", "fp32", 28, _S),
    Row(7, "torch_fused", "torch AdamW(fused=True)", "fp32", 28, ("torch_ref",)),
    Row(
        8,
        "torch_fused_copy",
        "torch fused + out.copy_(p) bf16",
        "fp32+bf16out",
        30,
        ("torch_ref", "tout"),
    ),
    Row(9, "torch_foreach", "torch AdamW(foreach=True)", "fp32", 28, ("torch_ref", "foreach")),
    Row(10, "deepspeed", "DeepSpeedCPUAdam", "fp32", 28, ("torch_ref", "deepspeed")),
    Row(11, "ours_bf16g_out", "ours bf16 grads + bf16 param_out", "bf16g+out", 28, (*_G, "out")),
    Row(12, "ours_rem", "ours remainders (hi + lo), bf16 grads", "rem", 26, ("rem", "gbf")),
    Row(
        13,
        "ours_bf16g_bf16mom_out",
        "ours bf16 grads + bf16 moments + param_out",
        "bf16g+bf16mom+out",
        20,
        ("state_bf16mom", "gbf", "out"),
    ),
    Row(
        14,
        "ours_rem_bf16mom",
        "ours remainders + bf16 moments",
        "rem+bf16mom",
        18,
        ("rem_bf16mom", "gbf"),
    ),
    Row(16, PROBE, "stream_probe (our pattern), 28 B", "fp32", 28, ("g32",)),
    Row(
        17,
        "ours_q8mom",
        "ours 8-bit moments, bf16 grads + param_out",
        "q8mom",
        16,
        ("state_q8", "gbf", "out"),
    ),
    Row(
        18, "ours_rem_q8mom", "ours remainders + 8-bit moments", "rem+q8mom", 14, ("rem_q8", "gbf")
    ),
    Row(19, "ours_fp32_oop", "ours fp32 grads, out of place", "fp32", 28, (*_S, "dst")),
    Row(20, "ours_rem_oop", "ours remainders, out of place", "rem", 26, ("rem", "gbf", "rem_dst")),
]
BY_KEY = {r.key: r for r in ROWS}
BY_NUM = {r.num: r for r in ROWS}

# (name, numerator, denominator, factor, target): value = factor * the paired ratio
# t_numerator / t_denominator (the median over repeats of the per-repeat ratio), timed
# in the denominator's round; a check runs only when its rows are selected.
CHECKS = [
    ("ours fp32 >= torch fused (speed ratio)", "torch_fused", "ours_fp32", 1.0, 1.0),
    ("ours fp32 >= DeepSpeed (speed ratio)", "deepspeed", "ours_fp32", 1.0, 1.0),
    (
        "ours + bf16 copy >= 1.15x torch fused + copy",
        "torch_fused_copy",
        "ours_fp32_bf16out",
        1.0,
        1.15,
    ),
    (
        "bf16 grads within 10% of fp32 time (1.1 * t_fp32 / t_bf16)",
        "ours_fp32",
        "ours_bf16g",
        1.10,
        1.0,
    ),
    (
        "decay_runs within 3% of one decay (1.03 * t_fp32 / t_runs)",
        "ours_fp32",
        "ours_decay_runs",
        1.03,
        1.0,
    ),
    ("ours fp32 within 10% of ceiling (t_ceiling / t_ours)", CEIL, "ours_fp32", 1.0, 0.90),
    ("ours + bf16 copy within 10% of ceiling", CEIL, "ours_fp32_bf16out", 1.0, 0.90),
    ("remainders within 10% of ceiling (26 B)", CEIL, "ours_rem", 1.0, 0.90),
    ("remainders + bf16 moments within 10% of ceiling (18 B)", CEIL, "ours_rem_bf16mom", 1.0, 0.90),
    (
        "remainders at <= 0.95x today's bf16 step (t_today / t_rem)",
        "ours_bf16g_out",
        "ours_rem",
        1.0,
        1 / 0.95,
    ),
    (
        "remainders + bf16 moments at <= 0.95x today's (t_today / t_rem)",
        "ours_bf16g_bf16mom_out",
        "ours_rem_bf16mom",
        1.0,
        1 / 0.95,
    ),
    (
        "out of place at the in-place speed (0.95 * t_in / t_out, fp32)",
        "ours_fp32",
        "ours_fp32_oop",
        1 / 0.95,
        1.0,
    ),
    (
        "out of place at the in-place speed (0.95 * t_in / t_out, remainders)",
        "ours_rem",
        "ours_rem_oop",
        1 / 0.95,
        1.0,
    ),
    ("8-bit moments within 10% of ceiling (16 B)", CEIL, "ours_q8mom", 1.0, 0.90),
    ("remainders + 8-bit moments within 10% of ceiling (14 B)", CEIL, "ours_rem_q8mom", 1.0, 0.90),
]


def select(spec: str | None, drop: tuple[str, ...] = ()) -> list[Row]:
    """The rows ``--rows`` names (numbers or keys, comma-separated; None or "all": every
    row), in catalogue order, less ``drop`` (e.g. deepspeed under --no-deepspeed).
    ValueError with one line naming --rows for a name that is no row."""
    if spec is None or spec.strip() in ("", "all"):
        chosen = {r.key for r in ROWS}
    else:
        chosen = set()
        for word in (w.strip() for w in spec.split(",")):
            row = BY_NUM.get(int(word)) if word.isdigit() else BY_KEY.get(word)
            if row is None:
                known = ", ".join(f"{r.num} {r.key}" for r in ROWS)
                raise ValueError(f"--rows: no row {word!r} (rows by number or name: {known})")
            chosen.add(row.key)
    return [r for r in ROWS if r.key in chosen and r.key not in drop]


def checks_for(rows: list[Row]) -> list[tuple]:
    """The checks whose rows are all selected (the ceiling always is)."""
    keys = {r.key for r in rows} | {CEIL}
    return [c for c in CHECKS if c[1] in keys and c[2] in keys]


def rounds(rows: list[Row], traffic_order) -> list[tuple[str, list[Row]]]:
    """(class, rows timed in its round) in ``traffic_order``: the class's own rows, then
    the partners its checks need from other classes, then the reference (when selected
    and not already there). Classes without a selected row of their own get no round."""
    keys = {r.key for r in rows}
    out = []
    for traffic in traffic_order:
        own = [r for r in rows if r.traffic == traffic]
        if not own:
            continue
        mine = {r.key for r in own}
        partners = [c[1] for c in checks_for(rows) if c[2] in mine and c[1] in BY_KEY]
        if REFERENCE in keys:
            partners.append(REFERENCE)
        extra = [BY_KEY[k] for k in dict.fromkeys(partners) if k not in mine]
        out.append((traffic, own + extra))
    return out


def bytes_needed(rows: list[Row], n: int, ceiling: dict[str, tuple[float, str]]) -> dict:
    """Peak bytes of a run over ``n`` elements: HEADROOM x (the persistent buffers plus
    the largest round: its rows' buffers, the grad buffer its ceiling patterns share and
    their scratch, ``ceiling[class] = (scratch bytes per element, grad buffer)``) + BASE.
    {"total", "persistent", "largest": (class, bytes)}."""
    used = {b for r in rows for b in r.buffers}
    persistent = sum(BUFFERS[b] for b in used if b in PERSISTENT) * n
    largest = ("", 0.0)
    for traffic, members in rounds(rows, ceiling):
        scratch, grad = ceiling[traffic]
        names = {b for r in members for b in r.buffers if b not in PERSISTENT} | {grad}
        size = (sum(BUFFERS[b] for b in names) + scratch) * n
        largest = max(largest, (traffic, size), key=lambda x: x[1])
    total = HEADROOM * (persistent + largest[1]) + BASE
    return {"total": total, "persistent": persistent, "largest": largest}


def refusal(need: dict, n: int, available: int | None, share: float = 0.9) -> str | None:
    """One line naming --sizes when ``need`` is over ``share`` of ``available`` bytes
    (MemAvailable or the cgroup limit; None: unknown, nothing refused)."""
    if available is None or need["total"] <= share * available:
        return None
    cls, size = need["largest"]
    size_text = f"{n:.0e}".replace("e+0", "e").replace("e+", "e")
    return (
        f"--sizes {size_text}: the rows chosen need about {need['total'] / 1e9:.1f} GB "
        f"(class {cls} {size / 1e9:.1f} GB + {need['persistent'] / 1e9:.1f} GB kept for the "
        f"whole run), over {share:.0%} of the {available / 1e9:.1f} GB available "
        f"(MemAvailable / cgroup limit): choose smaller --sizes or fewer --rows"
    )
