"""DPU is delayed, and the host never rewrites a staging that a copy up may still read.

**Delayed.** The DPU run D and a synchronous reference R, both from one initial model:
before each step R's parameters are set to D's (the stale ones D's forward uses), so R's
gradients are D's, bit for bit, and R's state after step t is what D's thread computes
for step t. After D's step t returns (its join published step t-1), D's parameters must
equal R's after step t-1; after the last flush D's master equals R's. A DPU that is in
truth synchronous, publishes early or late, or loses an upload fails this.

**Upload order** (``ledger.CopyLedger``): every write of the host Adam into a staging comes
after the wait on the event that covers the uploads reading it. On a GPU the stream is
made to sleep before each burst of uploads, so a missing wait overwrites a staging under
a copy that has not run yet: the ledger sees the write before the wait, and D's published
parameters stop matching R's. On the CPU the copies are synchronous, so the ledger (the
optimizer's ``streams``) puts it on the GPU's asynchronous path with fake events that only
record their order: the order is the same one the GPU relies on.

**The broken variant** (``drop_upload_events``) loses the optimizer's upload events, as if
the wait were removed: the check must then report FAIL.

**The forward's waits** (``optimizer/param_waits.py``): the copies up run on their own
stream and each module's forward waits for its own buckets. A DPU run whose forward does
not wait (its hooks emptied) reads, on a GPU whose upload stream sleeps first, the weights
before their copies land: its losses leave the reference's. A figure (on the CPU the copies
are done when they return, so nothing can differ there).
"""

from __future__ import annotations

import torch

from . import toy
from .equivalence import BF16, Section, bitwise
from .ledger import CopyLedger
from .report import check, fig

STEPS = 4
DELAY_S = 0.05  # the GPU stream's sleep before each burst of uploads


def dpu_run(sec: Section, steps: int = STEPS, broken: bool = False,
            no_forward_waits: bool = False) -> dict:  # fmt: skip
    """D (DPU from step 1) against R (synchronous, fed D's parameters), under the ledger;
    ``no_forward_waits``: D's forward does not wait for its uploads (its reads here wait
    for the whole device instead)."""
    built = {}
    delay = DELAY_S if sec.device.startswith("cuda") else 0.0
    ledger = CopyLedger(sec.device, delay_s=delay, drop_upload_events=broken)
    for name, warmup in (("dpu", 0), ("ref", None)):
        m = toy.model(sec.init, sec.device, BF16)
        opt = toy.zero(
            m, sec.device, dtype=BF16, bucket_size=sec.bucket_size, dpu_warmup_steps=warmup,
            streams=ledger if warmup is not None else None,
        )  # fmt: skip
        built[name] = (m, opt)
    (dm, dopt), (rm, ropt) = built["dpu"], built["ref"]
    if no_forward_waits:
        dopt.waits.wait_for = lambda buckets: None  # the hooks and params_ready wait for nothing
        dopt.params_ready = _whole_device
    ref_params = [toy.flat_params(rm)]  # R's after step 0, 1, ...
    out = dict(losses=[], published=[], ref_losses=[])
    if True:  # the ledger sees D's copies, events and host writes as they happen
        for s in range(steps):
            batch = sec.batches(s, 1)
            dopt.params_ready()  # the weights are read outside a forward: the uploads first
            ropt.params_ready()
            with torch.no_grad():
                for rp, dp in zip(rm.parameters(), dm.parameters()):
                    rp.copy_(dp)  # R's forward sees D's (stale) parameters
            out["ref_losses"].append(toy.step(ropt, rm, batch)[0])
            ref_params.append(toy.flat_params(rm, ropt))
            out["losses"].append(toy.step(dopt, dm, batch)[0])
            out["published"].append(bitwise(toy.flat_params(dm, dopt), ref_params[s]))
        dopt.flush()
    out["final"] = bitwise(toy.flat_params(dm), ref_params[-1])
    out["master"] = bitwise(toy.master(dopt), toy.master(ropt))
    out["ledger"] = ledger
    return out


def _order_line(name: str, ledger: CopyLedger) -> tuple:
    ups = sum(c.direction == "h2d" for c in ledger.copies)
    value = f"{ups} uploads, {ledger.waits} waits, {len(ledger.violations)} early writes"
    ok = ups > 0 and not ledger.violations
    return check(name, ok, value, "> 0 uploads; no host Adam write before its uploads' wait")


def dpu_delayed(sec: Section):
    run = dpu_run(sec)
    bad = [s + 1 for s, (ok, _) in enumerate(run["published"]) if not ok]
    value = "every step" if not bad else f"steps {bad} differ: {run['published'][bad[0] - 1][1]}"
    want = "after step t: bitwise R's after t-1 (R fed D's parameters)"
    yield check("dpu.delayed.published", not bad, value, want)
    yield check("dpu.delayed.losses", run["losses"] == run["ref_losses"], run["losses"], "== R's")
    yield check("dpu.delayed.final_params", *run["final"], "after the flush: R's after the last")
    yield check("dpu.delayed.master", *run["master"], "after the flush: R's, bitwise")
    yield _order_line("upload_order.dpu", run["ledger"])


def sync_order(sec: Section):
    """The synchronous step (fp32: the master itself goes up, on the CPU too)."""
    m = toy.model(sec.init, sec.device, torch.float32)
    delay = DELAY_S if sec.device.startswith("cuda") else 0.0
    ledger = CopyLedger(sec.device, delay_s=delay)
    opt = toy.zero(m, sec.device, dtype=torch.float32, bucket_size=sec.bucket_size, streams=ledger)
    for s in range(STEPS):
        toy.step(opt, m, sec.batches(s, 1))
    yield _order_line("upload_order.sync", ledger)


def _whole_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def without_forward_waits(sec: Section):
    """The forward's waits removed: on a GPU the losses leave the reference's."""
    run = dpu_run(sec, no_forward_waits=True)
    differ = sum(a != b for a, b in zip(run["losses"], run["ref_losses"]))
    yield fig("upload_order.without_forward_waits.losses_differ", differ, "GPU: > 0 likely")


def broken_variant(sec: Section):
    """The check is run on an optimizer with the upload wait removed: it must say FAIL."""
    run = dpu_run(sec, broken=True)
    kind, _, value, _ = _order_line("upload_order.dpu", run["ledger"])
    want = "FAIL: the order check catches a removed upload wait"
    yield check("upload_order.without_the_wait", kind == "FAIL", f"{kind}: {value}", want)
    differ = sum(not ok for ok, _ in run["published"])
    yield fig("upload_order.without_the_wait.steps_corrupted", differ, "GPU: > 0 likely")


TASKS = (dpu_delayed, sync_order, broken_variant, without_forward_waits)
