"""The whole proof in one process, in order of value, under one deadline:

1. calibration (``calibrate.py``): machine, pinned copies, host DRAM, CPU Adam rate, GEMM,
   SDPA determinism; written to ``calib.json`` too;
2. equivalences (``equivalence.py``) and the DPU / upload-order checks
   (``upload_order.py``), all from one initial model, deterministic algorithms on;
3. speed figures (``speed.py``);
4. one torchrun smoke run (``smoke.py``).

Each task has an estimate; one that would end past the deadline is skipped with a SKIP
line. Everything a task leaves besides its lines goes into the work directory, archived
into ``OUT/work.tar.gz`` after each section, so OUT holds at most five files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
import tempfile
from dataclasses import dataclass

import torch

from mp_offload.runtime.distributed import apply_cpu_threads, threads_per_rank

from . import calibrate as cal
from . import equivalence as eq
from . import smoke as sm
from . import speed as sp
from . import toy
from . import upload_order as uo
from .report import Budget, Summary, run_task

SECTIONS = ("calib", "equiv", "speed", "smoke")
DEADLINE_S = 250.0  # with the start-up and the extension check: a first call <= 5 minutes


@dataclass(frozen=True)
class Sizes:
    copy_mb: int
    gemm_n: int
    equiv_cfg: dict
    equiv_bucket: int
    bench_cfg: dict
    bench_rows: int
    bench_steps: tuple[int, int]  # warm-up, timed
    bench_bucket: int
    adam_numel: int


GPU = Sizes(512, 8192, toy.SMALL, 1 << 16, toy.MEDIUM, 4, (2, 4), 5_000_000, 50_000_000)
BENCH_CPU = dict(toy.TINY, num_layers=4, hidden_size=128, seq_length=128)
CPU = Sizes(16, 256, toy.TINY, 3000, BENCH_CPU, 2, (1, 3), 3000, 200_000)


def calibration(device, sizes: Sizes, calib: dict):
    yield "calib.machine", 2, lambda: cal.machine(calib, device)
    yield "calib.copies", 15, lambda: cal.copies(calib, device, sizes.copy_mb)
    yield "calib.host_dram", 8, lambda: cal.host_dram(calib, sizes.copy_mb)
    yield "calib.cpu_adam", 5, lambda: cal.cpu_adam(calib)
    yield "calib.gemm", 8, lambda: cal.gemm(calib, device, sizes.gemm_n)
    yield "calib.sdpa", 10, lambda: cal.sdpa_determinism(calib, device, sizes.equiv_cfg)


def equivalences(device, sizes: Sizes, calib: dict):
    pin = calib.get("sdpa_repeatable", {}).get("default", "yes") != "yes"
    sec = eq.Section(str(device), sizes.equiv_cfg, sizes.equiv_bucket, pin)
    for fn in (*eq.TASKS, *uo.TASKS):
        yield fn.__name__, 15, _deterministic(sec, fn)


def _deterministic(sec, fn):
    def task():
        with eq.deterministic(sec):
            yield from fn(sec)

    return task


def speed(device, sizes: Sizes, calib: dict):
    warmup, steps = sizes.bench_steps
    b = sp.Bench(str(device), sizes.bench_cfg, sizes.bench_rows, warmup, steps, sizes.bench_bucket)
    yield "speed.step_times", 70, lambda: sp.step_times(b, calib)
    yield "speed.traffic", 20, lambda: sp.traffic(b)
    yield "speed.cpu_adam", 8, lambda: sp.cpu_adam_gbs(b, sizes.adam_numel)
    yield "speed.d2h_overlap", 20, lambda: sp.d2h_overlap(b)


def smoke(device, work: str, budget: Budget):
    yield "smoke.torchrun", 60, lambda: sm.smoke(device.type, work, budget.left() - 5)


def _archive(work: str, out: str) -> None:
    """The work directory into OUT/work.tar.gz (replaced whole: a reader never sees half)."""
    tmp = os.path.join(out, ".work.tar.gz.part")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(work, arcname="work")
    os.replace(tmp, os.path.join(out, "work.tar.gz"))


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m device_proof", allow_abbrev=False)
    p.add_argument("--out", required=True, help="summary.txt, proof inputs, work.tar.gz")
    p.add_argument("--rehearsal", action="store_true", help="the CPU as the device, tiny sizes")
    p.add_argument("--deadline-s", type=float, default=None, help="the global deadline")
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help="a comma list of " + ", ".join(SECTIONS)
    )
    a = p.parse_args(argv)
    wanted = a.sections.split(",")
    bad = [s for s in wanted if s not in SECTIONS]
    if bad:
        p.error(f"--sections: unknown {', '.join(bad)} (choose from {', '.join(SECTIONS)})")
    return a, wanted


def _load_calib(out: str) -> dict:
    try:
        with open(os.path.join(out, "calib.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def main(argv=None) -> int:
    a, wanted = parse(argv)
    if not a.rehearsal and not torch.cuda.is_available():
        print("device_proof: error: no CUDA device (--rehearsal runs on the CPU)", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    device = torch.device("cpu" if a.rehearsal else "cuda", None if a.rehearsal else 0)
    sizes = CPU if a.rehearsal else GPU
    budget = Budget(a.deadline_s or DEADLINE_S)
    summary = Summary(os.path.join(a.out, "summary.txt"))
    work = tempfile.mkdtemp(prefix="device_proof_work_")
    print(f"device_proof: {apply_cpu_threads(threads_per_rank(gpu=not a.rehearsal))}", flush=True)
    print(f"device_proof: sections {', '.join(wanted)}; deadline {budget.left():.0f} s", flush=True)
    calib = _load_calib(a.out)
    sections = dict(
        calib=lambda: calibration(device, sizes, calib),
        equiv=lambda: equivalences(device, sizes, calib),
        speed=lambda: speed(device, sizes, calib),
        smoke=lambda: smoke(device, work, budget),
    )
    for name in SECTIONS:
        if name not in wanted:
            continue
        for task_name, estimate, task in sections[name]():
            run_task(summary, budget, task_name, estimate, task)
        if name == "calib":
            with open(os.path.join(a.out, "calib.json"), "w") as f:
                json.dump(calib, f, indent=1, default=str)
        _archive(work, a.out)
    fails, skips = summary.count("FAIL"), summary.count("SKIP")
    print(
        f"device_proof: {summary.count('PASS')} passed, {fails} failed, {skips} skipped, "
        f"{summary.count('FIG')} figures; {summary.path}",
        flush=True,
    )
    return 1 if fails else (3 if skips else 0)
