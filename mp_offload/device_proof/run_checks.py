"""Stage 3's asserts, as pure functions of the runs' records, plans and calibration."""

from __future__ import annotations

import statistics

from ..model.gpt import GPTConfig
from ..planner.throughput import Machine, step_time
from .checks import Check, at_most, equal, finite, within
from .runs import DPU_WARMUP, MODES, PRACTICALITY, Size, micro_batches

LOSS_REL = 1e-2  # the loss at the last iteration, offload against no offload
RESERVED_REL = 0.10  # peak reserved device memory against the plan
TFLOPS_REL = 0.25  # measured against the throughput model fed with calib.json
SLOW_ADAM_S = 0.3  # DPU must win once the Adam takes this long


def expected_bytes_per_param(mode: str, iteration: int) -> float:
    """ZeRO-Offload moves 2 B/param down and 2 up per step in bf16; with
    --accumulate-grads-on-device the sum comes down once per step in fp32 (4 B, as the host
    path sums it); under DPU the upload of step i happens at step i+1 (after the warm-up),
    so the record of step i counts i-1 uploads."""
    if mode.startswith("no-offload"):
        return 0.0
    down = 4.0 if "device" in mode else 2.0
    if "dpu" in mode and iteration > DPU_WARMUP:
        return down + 2.0 - 2.0 / iteration
    return down + 2.0


def steady_median(recs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in recs[2:] or recs if finite(r.get(key))]
    return statistics.median(vals) if vals else None


def loss_checks(runs: dict[str, list[dict]], size: Size) -> list[Check]:
    out = [equal(f"{m}.iterations", len(runs.get(m, [])), size.iters) for m in MODES]
    for mode in MODES:
        # the practicality runs against no offload at their own k: the same batches
        base = runs.get(PRACTICALITY.get(mode, "no-offload"), [])
        recs = runs.get(mode, [])
        if mode.startswith("no-offload") or not recs or not base:
            continue
        if micro_batches(mode, size) == 1 or mode in PRACTICALITY:  # same batches, weights
            out.append(equal(f"{mode}.loss@1", recs[0]["loss"], base[0]["loss"]))
        else:  # k micro-batches see more data than no offload's one
            out.append(within(f"{mode}.loss@1", recs[0]["loss"], base[0]["loss"], LOSS_REL))
        out.append(
            within(f"{mode}.loss@{size.iters}", recs[-1]["loss"], base[-1]["loss"], LOSS_REL)
        )
    sync, dpu = runs.get("offload", []), runs.get("offload-dpu", [])
    n = DPU_WARMUP + 1  # the warm-up steps and the first step after them see the same weights
    out.append(
        equal(
            "offload-dpu.warmup_losses",
            [r["loss"] for r in dpu[:n]],
            [r["loss"] for r in sync[:n]],
            " (sync offload's)",
        )
    )
    return out


def traffic_checks(runs: dict[str, list[dict]], plans: dict, cuda: bool) -> list[Check]:
    out = []
    for mode, recs in runs.items():
        dev = [
            abs(
                r.get("host_device_bytes_per_param", -1)
                - expected_bytes_per_param(mode, r["iteration"])
            )
            for r in recs
        ]
        out.append(
            at_most(
                f"{mode}.bytes_per_param_error",
                max(dev, default=None),
                1e-9,
                " (4; 6 with device accumulation; 2/i less under DPU)",
            )
        )
    base = runs.get("no-offload") or [{}]
    for mode, recs in runs.items():
        if mode.startswith("no-offload") or not recs:
            continue
        staging = plans.get(mode, {}).get("host", {}).get("staging")
        want = staging if cuda else 0  # the CPU pins nothing
        out.append(
            equal(
                f"{mode}.pinned_bytes",
                recs[-1].get("pinned_host_bytes"),
                want,
                " (the plan's staging)" if cuda else " (rehearsal: nothing pinned)",
            )
        )
        out.append(
            equal(
                f"{mode}.host_allocator_bytes",
                recs[-1].get("host_allocator_bytes"),
                base[-1].get("host_allocator_bytes"),
                " (no-offload's: registration bypasses it)",
            )
        )
    return out


def memory_checks(runs: dict[str, list[dict]], plans: dict, cuda: bool) -> list[Check]:
    out = []
    for mode, recs in runs.items():
        peak = max((r.get("peak_device_reserved_gb", -1) for r in recs), default=None)
        plan = plans.get(mode, {}).get("device_total")
        plan_gb = plan / 1e9 if finite(plan) else None
        if cuda:
            out.append(
                within(f"{mode}.peak_reserved_gb", peak, plan_gb, RESERVED_REL, " (the plan, GB)")
            )
        else:  # no device allocator on the CPU: measured 0, and the plan was made
            ok = peak == 0 and finite(plan_gb) and plan_gb > 0
            out.append(
                Check(
                    f"{mode}.peak_reserved_gb", ok, peak, f"== 0 on the CPU, plan {plan_gb} GB > 0"
                )
            )
    return out


PHASES = ("phase_zero_grad_ms", "phase_forward_backward_ms", "phase_optimizer_ms")
BACKWARD_REL = 1.15  # forward+backward with offload against without (the copies overlap)


def phase_checks(runs: dict[str, list[dict]], cuda: bool) -> list[Check]:
    """The phase timers are logged and fit in their iteration (device time between events
    on the compute stream cannot exceed the wall time around them); on a GPU forward and
    backward with offload take at most 1.15x those without (medians)."""
    out = []
    for mode, recs in runs.items():
        over = [sum(r.get(p, float("nan")) for p in PHASES) - r["elapsed_ms"] for r in recs]
        worst = max(over) if over and all(map(finite, over)) else None  # a missing phase: None
        out.append(at_most(f"{mode}.phases_minus_iteration_ms", worst, 1.0))
    base = steady_median(runs.get("no-offload", []), "phase_forward_backward_ms")
    for mode in ("offload", "offload-dpu") if cuda else ():
        fb = steady_median(runs.get(mode, []), "phase_forward_backward_ms")
        ratio = fb / base if finite(fb) and finite(base) and base > 0 else None
        out.append(
            at_most(f"{mode}.forward_backward_ratio", ratio, BACKWARD_REL, " (no offload's)")
        )
    return out


def dpu_verdict(adam_s: float, s_ms, d_ms, factor: float, what: str) -> Check:
    """DPU must beat sync once the Adam takes > 0.3 s; with a shorter Adam it can only be
    not much slower (``factor``)."""
    if not (finite(s_ms) and finite(d_ms)):
        return Check("offload-dpu.ms_per_iter", False, d_ms, "both measured")
    if adam_s > SLOW_ADAM_S:
        ok, want = d_ms < s_ms, f"< {s_ms:.1f} ({what}; its Adam takes {adam_s:.2f} s)"
    else:
        ok = d_ms <= factor * s_ms
        want = (
            f"<= {factor} x {s_ms:.1f} ({what}; its Adam takes {adam_s * 1e3:.1f} ms "
            f"< {SLOW_ADAM_S} s: DPU cannot win)"
        )
    return Check("offload-dpu.ms_per_iter", ok, d_ms, want)


def dpu_check(runs: dict[str, list[dict]]) -> Check:
    """On a GPU: the medians of the DPU run and the sync offload run."""
    sync, dpu = runs.get("offload", []), runs.get("offload-dpu", [])
    adam_s = (steady_median(sync, "optimizer_ms") or 0.0) / 1e3
    s_ms, d_ms = steady_median(sync, "elapsed_ms"), steady_median(dpu, "elapsed_ms")
    return dpu_verdict(adam_s, s_ms, d_ms, 1.5, "sync's median")


def machine_from(calib: dict, adam_rate: float | None) -> Machine:
    m = Machine(
        device_tflops=calib["gemm_tflops"],
        devices_per_node=1,
        pcie_gbs=min(calib["d2h_gbs"], calib["h2d_gbs"]),
        cpu_cores_per_node=calib["cores"],
        host_mem_gbs=calib["host_stream_gbs"],
        device_mem_gbs=calib["device_mem_gbs"],
    )
    if adam_rate:
        m.adam_rate_per_core = adam_rate
    return m


def tflops_check(name: str, measured, predicted, rehearsal: bool) -> Check:
    """On a GPU: within 25% of the model. In the rehearsal a tiny model on the CPU is bound
    by Python's overheads, which the model leaves out: the model is then only an upper
    bound (measured > 0 and at most 1.25x the model's)."""
    if not rehearsal:
        return within(name, measured, predicted, TFLOPS_REL, " (the throughput model)")
    ok = finite(measured) and finite(predicted) and 0 < measured <= 1.25 * predicted
    return Check(
        name, ok, measured, f"in (0, 1.25 x {predicted:.4g}] (rehearsal: the model bounds it)"
    )


def tflops_checks(runs, size: Size, machine: Machine, rehearsal: bool) -> list[Check]:
    cfg = GPTConfig(
        num_layers=size.layers,
        hidden_size=size.hidden,
        num_attention_heads=size.heads,
        seq_length=size.seq,
        vocab_size=size.vocab,
    )
    out = []
    for mode, recs in runs.items():
        k = micro_batches(mode, size)
        model = step_time(
            cfg,
            1,
            machine,
            batch_per_gpu=k * size.micro,
            micro_batch=size.micro,
            mode="zero2" if mode.startswith("no-offload") else "offload",
            accumulate_on_device="device" in mode,
        )
        predicted = model.tflops_dpu if "dpu" in mode else model.tflops_sync
        if "overlap" in mode:  # the same FLOPs in the overlapped step's time
            predicted = model.tflops_sync * model.step_sync / model.step_overlap
        measured = steady_median(recs, "tflops_per_device")
        print(f"device_proof: {mode}: {measured} TFLOPS measured, {predicted:.4g} modelled")
        out.append(tflops_check(f"{mode}.tflops", measured, predicted, rehearsal))
    return out
