"""k > 1 micro-batches summed on the host, as on a GPU: two grad stagings alternate per
micro-batch, and the training thread waits for the host's sums only before it reuses a
staging, never after each micro-batch. Checked on the CPU with the race checker
(``stream_checker``: copies land late unless ordered) and the worker held back: the
event order, and the result bit for bit against the synchronous run."""

import threading

import pytest
import torch
from helpers import tiny_gpt_config
from stream_checker import RaceStreams, gpu_placement
from zero_helpers import build_zero

from mp_offload import parallel_state as ps
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer import host_accumulator, host_side
from mp_offload.optimizer.options import OptimizerOptions
from mp_offload.optimizer.placement import placement

SINGLE = ps.ParallelGroup.single()
HP = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=1.0)
K = 4
HOST_SUMS = OptimizerOptions(dtype=torch.bfloat16, bucket_size=900, micro_batches=K)
HOLD_S = 10.0  # how long a held-back sum waits for the next micro-batch's first copy


def _run(streams=None, steps=2):
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**tiny_gpt_config()), tp_group=SINGLE)
    opt = build_zero(model, **HP, dp=SINGLE, tp=SINGLE, device="cpu", options=HOST_SUMS,
                     streams=streams)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad(lr=HP["lr"])
        for _ in range(K):
            t = torch.randint(0, 64, (2, 17), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                opt.backward(model(t[:, :-1], t[:, 1:]).float().mean() / K)
        opt.step()
    return opt, opt.flat.clone()


class _Recorder(RaceStreams):
    """Logs each copy down as (micro-batch, staging). The sums of micro-batch i are held
    until micro-batch i + 2 is about to rewrite (or rewrites) their staging: a thread
    that waits after each micro-batch then waits for ever (until ``HOLD_S``), and one that
    rewrites a staging before its sums are done is caught by the checker."""

    def __init__(self):
        super().__init__()
        self.micro, self.log, self.timed_out = 0, [], []
        self.reached = [threading.Event() for _ in range(64)]

    def copy_down(self, dst, src, after=None):
        self.log.append(("copy", self.micro, dst.untyped_storage().data_ptr()))
        self.reached[self.micro].set()
        return super().copy_down(dst, src, after)

    def held(self, work, micro: int):
        def job():
            # (not the last two of a step: the last micro-batch waits for every sum)
            if micro % K < K - 2 and not self.timed_out:
                if not self.reached[micro + 2].wait(HOLD_S):
                    self.timed_out.append(micro)  # and holds nothing more: fail in HOLD_S
            work()
            self.log.append(("summed", micro, None))

        return job


def test_two_stagings_alternate_and_the_host_waits_only_before_a_reuse(monkeypatch):
    rec = _Recorder()
    real_end, real_submit = host_side.HostSide.end_backward, host_accumulator.HostAccumulator.submit
    real_reuse = host_side.HostSide._reuse

    def end_backward(self, micro):
        real_end(self, micro)
        rec.micro += 1

    def submit(self, work, ready=None):
        real_submit(self, rec.held(work, rec.micro), ready)

    def reuse(self, staging):
        rec.reached[rec.micro].set()  # about to wait for the sums that read ``staging``
        real_reuse(self, staging)

    monkeypatch.setattr(host_side.HostSide, "end_backward", end_backward)
    monkeypatch.setattr(host_side.HostSide, "_reuse", reuse)
    monkeypatch.setattr(host_accumulator.HostAccumulator, "submit", submit)
    with gpu_placement():
        opt, late = _run(rec)
    # The training thread went on to micro-batch i + 1 while micro-batch i was summed:
    # nothing waited after a micro-batch (with one staging it waited there, and the
    # held-back sum timed out).
    assert rec.timed_out == []
    assert opt.host_side.per_micro and len(opt.host_side.staging_copies) == 2
    copies = [(m, ptr) for what, m, ptr in rec.log if what == "copy"]
    stagings = {m: {ptr for mm, ptr in copies if mm == m} for m, _ in copies}
    assert all(len(s) == 1 for s in stagings.values()), "a micro-batch used two stagings"
    assert len({next(iter(stagings[m])) for m in (0, 1)}) == 2, "one staging, not two"
    for m in stagings:  # micro-batch m and m + 2 share one; m and m + 1 do not
        if m + 1 in stagings:
            assert stagings[m] != stagings[m + 1], m
    # A staging is rewritten only after every sum of the micro-batch it held: micro-batch
    # m's first copy comes after the last sum of micro-batch m - 2.
    for m in stagings:
        if m >= 2:
            at = [(i, what) for i, (what, mm, _) in enumerate(rec.log) if mm in (m, m - 2)]
            first_copy = min(i for i, what in at if what == "copy" and rec.log[i][1] == m)
            summed = [i for i, what in at if what == "summed" and rec.log[i][1] == m - 2]
            assert summed and max(summed) < first_copy, m
    _, sync = _run()
    assert torch.equal(late, sync), "the alternating stagings changed the result"


@pytest.mark.parametrize("device_type, stagings", [("cuda", 2), ("cpu", 1)])
def test_the_placement_holds_two_stagings_only_where_a_worker_sums(device_type, stagings):
    """On a CPU "device" the copy down is the sum's own input, done before it returns."""
    model = GPTModel(GPTConfig(**tiny_gpt_config()), tp_group=SINGLE)
    opt = build_zero(model, **HP, dp=SINGLE, tp=SINGLE, device="cpu", options=HOST_SUMS)
    place = placement(opt.layout, HOST_SUMS, device_type)
    assert place.buffer("grad_staging").copies == stagings
    one = placement(opt.layout, OptimizerOptions(dtype=torch.bfloat16, bucket_size=900), "cuda")
    assert one.buffer("grad_staging").copies == 1  # k = 1: Adam reads the one staging
