"""k > 1 micro-batches summed on the host, as on a GPU: the training thread does not wait
for the host's sums after a micro-batch; a copy down waits only for the sums that still
read its bucket's part of the staging. Checked on the CPU with the race checker
(``stream_checker``: copies land late unless ordered) and the worker held back: the
event order, and the result bit for bit against the synchronous run."""

import threading

import torch
from helpers import tiny_gpt_config
from stream_checker import RaceStreams, gpu_placement
from zero_helpers import build_zero

from mp_offload import parallel_state as ps
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer import host_accumulator, host_side
from mp_offload.optimizer.options import OptimizerOptions

SINGLE = ps.ParallelGroup.single()
HP = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=1.0)
K = 4
HOST_SUMS = OptimizerOptions(dtype=torch.bfloat16, bucket_size=900, micro_batches=K)
HOLD_S = 30.0  # how long a held-back sum waits for the next micro-batch to reach the staging


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
    opt.flush()  # the last step's uploads land (on a GPU: are ordered) before the read
    return opt, opt.flat.clone()


class _Recorder(RaceStreams):
    """Logs each copy down and each host sum as (what, micro-batch, bucket's staging
    address). The sums of micro-batch i (but a step's last) are held until micro-batch
    i + 1 is about to rewrite the staging (a ``_reuse`` or a copy down): a thread that
    waits after each micro-batch then waits for ever (until ``HOLD_S``), and one that
    rewrites a bucket's staging before its sum is done is caught."""

    def __init__(self):
        super().__init__()
        self.micro, self.log, self.timed_out, self.job_micro = 0, [], [], None
        self.reached = [threading.Event() for _ in range(64)]

    def copy_down(self, dst, src, after=None):
        self.log.append(("copy", self.micro, dst.data_ptr()))
        self.reached[self.micro].set()
        return super().copy_down(dst, src, after)

    def held(self, work, micro: int):
        def job():
            if micro % K != K - 1 and not self.timed_out:  # the last: waited for, not held
                if not self.reached[micro + 1].wait(HOLD_S):
                    self.timed_out.append(micro)  # and holds nothing more: fail in HOLD_S
            self.job_micro = micro
            work()

        return job


def test_the_host_waits_only_before_a_buckets_staging_is_rewritten(monkeypatch):
    rec = _Recorder()
    real_end, real_submit = host_side.HostSide.end_backward, host_accumulator.HostAccumulator.submit
    real_reuse, real_sum = host_side.HostSide._reuse, host_side.accumulate_

    def end_backward(self, micro):
        real_end(self, micro)
        rec.micro += 1

    def submit(self, work, ready=None):
        real_submit(self, rec.held(work, rec.micro), ready)

    def reuse(self, b):
        rec.reached[rec.micro].set()  # about to wait for the sums that read b's staging
        real_reuse(self, b)

    def accumulate(grad, stage, **kw):
        out = real_sum(grad, stage, **kw)
        rec.log.append(("summed", rec.job_micro, stage.data_ptr()))
        return out

    monkeypatch.setattr(host_side.HostSide, "end_backward", end_backward)
    monkeypatch.setattr(host_side.HostSide, "_reuse", reuse)
    monkeypatch.setattr(host_side, "accumulate_", accumulate)
    monkeypatch.setattr(host_accumulator.HostAccumulator, "submit", submit)
    with gpu_placement():
        opt, late = _run(rec)
    # The training thread went on to micro-batch i + 1 while micro-batch i was summed:
    # nothing waited after a micro-batch (waiting there, the held-back sum timed out).
    assert rec.timed_out == []
    assert len(opt.host_side.staging_copies) == 1  # and no second staging for it
    # A bucket's staging is rewritten only after its last sum: micro-batch m's copy into
    # it comes after micro-batch m - 1's sum of it.
    copies = [(i, m, at) for i, (what, m, at) in enumerate(rec.log) if what == "copy"]
    sums = {(m, at): i for i, (what, m, at) in enumerate(rec.log) if what == "summed"}
    assert len(sums) == len(copies) == 2 * K * len(opt.host_side.pieces)
    for i, m, at in copies:
        if m > 0:
            assert sums[(m - 1, at)] < i, (m, at)
    _, sync = _run()
    assert torch.equal(late, sync), "the overlapped sums changed the result"
