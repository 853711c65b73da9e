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
parameters stop matching R's. On the CPU the copies are synchronous and the optimizer
makes no events, so the optimizer is put on the GPU's path (``_as_if_pinned``: its events
are fakes that only record their order): the order is the same one the GPU relies on.

**The broken variant** (``skip_upload_wait``) drops the optimizer's upload event after each
publish, as if the wait were removed: the check must then report FAIL.
"""

from __future__ import annotations

import dataclasses

import torch

from . import toy
from .equivalence import BF16, Section, bitwise
from .ledger import CopyLedger
from .report import check, fig

STEPS = 4
DELAY_S = 0.05  # the GPU stream's sleep before each burst of uploads


def _as_if_pinned(opt) -> None:
    """CPU only: take the GPU's event path (an upload event after each publish, waited on
    before the next host Adam writes the staging); the ledger's fake events stand in."""
    if opt.device.type == "cpu":
        opt.placement = dataclasses.replace(opt.placement, pinned=True)


def skip_upload_wait(opt) -> None:
    """The deliberately broken optimizer: its upload event is forgotten after each
    publish, so the next host Adam does not wait for the copies up."""
    publish = opt._publish

    def without_the_event(*args, **kwargs):
        publish(*args, **kwargs)
        opt._uploaded = None

    opt._publish = without_the_event


def dpu_run(sec: Section, steps: int = STEPS, broken: bool = False) -> dict:
    """D (DPU from step 1) against R (synchronous, fed D's parameters), under the ledger."""
    built = {}
    for name, warmup in (("dpu", 0), ("ref", None)):
        m = toy.model(sec.init, sec.device, BF16)
        opt = toy.zero(
            m, sec.device, dtype=BF16, bucket_size=sec.bucket_size, dpu_warmup_steps=warmup
        )
        built[name] = (m, opt)
    (dm, dopt), (rm, ropt) = built["dpu"], built["ref"]
    _as_if_pinned(dopt)
    if broken:
        skip_upload_wait(dopt)
    ref_params = [toy.flat_params(rm)]  # R's after step 0, 1, ...
    out = dict(losses=[], published=[], ref_losses=[])
    delay = DELAY_S if sec.device.startswith("cuda") else 0.0
    with CopyLedger(dopt, delay_s=delay) as ledger:
        for s in range(steps):
            batch = sec.batches(s, 1)
            with torch.no_grad():
                for rp, dp in zip(rm.parameters(), dm.parameters()):
                    rp.copy_(dp)  # R's forward sees D's (stale) parameters
            out["ref_losses"].append(toy.step(ropt, rm, batch)[0])
            ref_params.append(toy.flat_params(rm))
            out["losses"].append(toy.step(dopt, dm, batch)[0])
            out["published"].append(bitwise(toy.flat_params(dm), ref_params[s]))
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
    opt = toy.zero(m, sec.device, dtype=torch.float32, bucket_size=sec.bucket_size)
    _as_if_pinned(opt)
    delay = DELAY_S if sec.device.startswith("cuda") else 0.0
    with CopyLedger(opt, delay_s=delay) as ledger:
        for s in range(STEPS):
            toy.step(opt, m, sec.batches(s, 1))
    yield _order_line("upload_order.sync", ledger)


def broken_variant(sec: Section):
    """The check is run on an optimizer with the upload wait removed: it must say FAIL."""
    run = dpu_run(sec, broken=True)
    kind, _, value, _ = _order_line("upload_order.dpu", run["ledger"])
    want = "FAIL: the order check catches a removed upload wait"
    yield check("upload_order.without_the_wait", kind == "FAIL", f"{kind}: {value}", want)
    differ = sum(not ok for ok, _ in run["published"])
    yield fig("upload_order.without_the_wait.steps_corrupted", differ, "GPU: > 0 likely")


TASKS = (dpu_delayed, sync_order, broken_variant)
