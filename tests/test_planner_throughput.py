"""planner/throughput.py: the step-time model, its plot, and the bytes it charges."""

import sys

import pytest
import torch
from planner_cases import HP, SMALL
from zero_helpers import build_zero, host_tensor

from mp_offload import parallel_state as ps
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer.zero import ZeroOptimizer
from mp_offload.planner import (
    rank_shapes,
    spec_named_params,
)
from mp_offload.planner.throughput import Machine, plot_scaling, scaling, ten_b


def test_throughput_model_matches_the_paper_claim():
    rows = scaling(ten_b(), Machine())
    assert 30 <= rows[0].tflops_sync <= 50  # paper: ~40 TFLOPS on one V100 at 10B
    assert all(r.tflops_sync > 30 for r in rows)  # paper: >30 TF/GPU from 1 to 128 GPUs
    assert all(r.tflops_dpu >= r.tflops_sync for r in rows)


def test_plot_degrades_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    path = tmp_path / "x.png"
    assert plot_scaling(scaling(ten_b(), Machine(), gpus=(1, 2)), str(path), "t") is False
    assert not path.exists()


def test_plot_written_with_matplotlib(tmp_path):
    path = tmp_path / "x.png"
    assert plot_scaling(scaling(ten_b(), Machine(), gpus=(1, 2)), str(path), "t") is True
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_step_time_without_offload_has_no_host_terms():
    cfg = ten_b()
    machine = Machine()
    off, z2, pt = (
        scaling(cfg, machine, gpus=(8,), mode=m)[0] for m in ("offload", "zero2", "pytorch")
    )
    assert off.copy_up > 0 and z2.copy_up == pt.copy_up == 0
    assert z2.accumulate == pt.accumulate == 0 and pt.all_gather == 0 < z2.all_gather
    assert z2.adam < off.adam and z2.step_dpu == z2.step_sync
    assert off.compute == z2.compute == pt.compute
    for st in (off, z2, pt):
        assert st.tokens_per_step == 16 * 8 * 1024
        assert st.tokens_per_day == pytest.approx(st.tokens_per_step * 86400 / st.step_sync)
        assert st.days_per_billion_tokens == pytest.approx(1e9 / st.tokens_per_day)


def _offload_optimizer(dtype, moments, **options) -> ZeroOptimizer:
    """A one-rank offload ZeroOptimizer of the SMALL model (both moments in ``moments``)."""
    single = ps.ParallelGroup.single()
    return build_zero(
        GPTModel(GPTConfig(**SMALL), tp_group=single),
        **HP,
        dp=single,
        tp=single,
        device="cpu",
        dtype=dtype,
        cpu_offload=True,
        exp_avg_dtype=moments,
        exp_avg_sq_dtype=moments,
        **options,
    )


@pytest.mark.parametrize(
    "dtype,k,moments",
    [
        (torch.bfloat16, 1, torch.float32),  # Adam reads the bf16 staging itself
        (torch.bfloat16, 2, torch.float32),  # the fp32 sum of two micro-batches
        (torch.bfloat16, 1, torch.bfloat16),  # bf16 moments
        (torch.float32, 1, torch.float32),  # no rounded copy: the master goes up
    ],
)
def test_throughput_charges_the_bytes_of_the_real_adam_buffers(dtype, k, moments):
    """The planner's CPU Adam bytes per element are those of the buffers a real
    ZeroOptimizer hands its Adam, counted by ops/traffic.py (the benchmarks' account)."""
    from mp_offload.ops.traffic import adam_arrays, bytes_per_element
    from mp_offload.planner.throughput import host_adam_bytes

    opt = _offload_optimizer(dtype=dtype, micro_batches=k, moments=moments)
    size = lambda t: 0 if t is None else t.element_size()  # noqa: E731
    real = adam_arrays(
        size(opt.host_side.adam_grads),
        size(host_tensor(opt, "exp_avg")),
        size(host_tensor(opt, "exp_avg_sq")),
        size(host_tensor(opt, "param_staging")),
    )
    assert size(host_tensor(opt, "master")) == 4
    e = torch.finfo(dtype).bits // 8
    want = host_adam_bytes(
        e, e, k == 1, (size(host_tensor(opt, "exp_avg")), size(host_tensor(opt, "exp_avg_sq")))
    )
    assert bytes_per_element(real) == want


def test_throughput_charges_the_remainder_step_its_own_bytes():
    """--store-param-remainders: the host master is the bf16 param that goes up (the
    staging, hi) and its int16 remainder (lo), both read and written, and nothing is copied
    out: 26 B per element with bf16 grads and fp32 moments, 18 with bf16 moments, 2 fewer
    than the fp32 master's step."""
    from mp_offload.ops.traffic import READ, READ_WRITE, bytes_per_element
    from mp_offload.planner.throughput import host_adam_bytes

    for moments, want in ((torch.float32, 26), (torch.bfloat16, 18)):
        opt = _offload_optimizer(torch.bfloat16, moments=moments, store_param_remainders=True)
        real = [
            ("hi", host_tensor(opt, "param_staging").element_size(), READ_WRITE),
            ("lo", host_tensor(opt, "master").element_size(), READ_WRITE),
            ("grad", opt.host_side.adam_grads.element_size(), READ),
            ("exp_avg", host_tensor(opt, "exp_avg").element_size(), READ_WRITE),
            ("exp_avg_sq", host_tensor(opt, "exp_avg_sq").element_size(), READ_WRITE),
        ]
        m = (
            host_tensor(opt, "exp_avg").element_size(),
            host_tensor(opt, "exp_avg_sq").element_size(),
        )
        assert bytes_per_element(real) == host_adam_bytes(2, 2, True, m, True) == want
        assert host_adam_bytes(2, 2, True, m) == want + 2


def test_throughput_charges_only_the_passes_the_code_makes():
    """No zeroing or norm pass; no accumulation at k = 1 or with device accumulation (only
    its last micro-batch's copies go down); the host sum's first micro-batch overwrites."""
    from mp_offload.optimizer.base import DEFAULT_BUCKET_SIZE
    from mp_offload.planner.throughput import step_time

    cfg = ten_b()
    slow_pcie = Machine(pcie_gbs=1.0)  # copies longer than backward: exposure is visible
    one = step_time(cfg, 1, slow_pcie, batch_per_gpu=4, micro_batch=4)
    assert one.zero == one.norm == one.accumulate == 0.0
    host = step_time(cfg, 1, slow_pcie, batch_per_gpu=16, micro_batch=4)
    dev = step_time(cfg, 1, slow_pcie, batch_per_gpu=16, micro_batch=4, accumulate_on_device=True)
    assert host.grad_exposed == pytest.approx(4 * one.grad_exposed) and host.grad_exposed > 0
    assert dev.grad_exposed == pytest.approx(one.grad_exposed) and dev.accumulate == 0.0
    # A host too slow to hide the sum: 6 B per element for the first, 10 for the others.
    slow_host = Machine(host_mem_gbs=1.0, pcie_gbs=1e6)
    acc = step_time(cfg, 1, slow_host, batch_per_gpu=16, micro_batch=4)
    bwd = step_time(cfg, 1, slow_host, batch_per_gpu=4, micro_batch=4).compute * 3 / 4
    n = rank_shapes(spec_named_params(cfg, 1), 1, DEFAULT_BUCKET_SIZE).slice_numel
    assert acc.accumulate == pytest.approx((6 + 3 * 10) * n / 1e9 - 4 * bwd)


def test_overlap_hides_the_cpu_adam_under_a_long_backward():
    """The paper's 10B on one V100: backward is long, so with --overlap-cpu-optimizer the
    CPU Adam runs under it but for the last bucket's (its gradient lands as backward
    ends): the step keeps that piece and the forward's wait for the copies up, which follow
    the worker (the synchronous step hides its copies under its own CPU Adam)."""
    from mp_offload.optimizer.base import DEFAULT_BUCKET_SIZE
    from mp_offload.planner.throughput import step_time

    cfg = ten_b()
    st = step_time(cfg, 1, Machine(), batch_per_gpu=4, micro_batch=4)
    chunks = rank_shapes(spec_named_params(cfg, 1), 1, DEFAULT_BUCKET_SIZE).chunks
    last = st.adam_host * chunks[-1] / sum(chunks)
    assert st.adam_host > 1.0 and st.accumulate == 0.0
    assert st.host_exposed == pytest.approx(last + st.publish_overlap)
    assert 0 < st.publish_overlap < st.copy_up  # the forward hides part of the copies
    assert st.publish_sync < 1e-3 * st.copy_up  # all but nothing hides under the CPU Adam
    assert st.step_overlap == pytest.approx(
        st.step_sync - st.adam - st.publish_sync + st.host_exposed
    )
    assert 0 < st.host_hidden < st.adam_host
    assert 0 < st.hide_tokens_per_step < st.tokens_per_step  # it keeps up here


def test_overlap_with_a_slow_host_exposes_what_backward_cannot_cover():
    """A CPU Adam far longer than backward: the worker runs without a pause from the first
    host gradient on, so its seconds are either hidden (before the end of backward) or
    exposed, and then the copies up follow."""
    from mp_offload.planner.throughput import step_time

    slow = Machine(adam_rate_per_core=1e6)
    st = step_time(ten_b(), 1, slow, batch_per_gpu=4, micro_batch=4)
    assert st.adam_host > 10 * st.compute
    assert st.host_hidden + st.host_exposed - st.publish_overlap == pytest.approx(st.adam_host)
    assert st.step_overlap == pytest.approx(
        st.step_sync - st.adam - st.publish_sync + st.host_exposed
    )
    assert st.step_overlap < st.step_sync
    assert st.hide_tokens_per_step > st.tokens_per_step  # it does not keep up


@pytest.mark.parametrize("accumulate_on_device", [False, True])
def test_overlap_hiding_point_does_not_depend_on_the_micro_batch(accumulate_on_device):
    """The tokens per step from which the worker keeps up are a property of the machine
    and the model at a micro-batch count: growing the micro-batch moves both the backward
    and the tokens per step together."""
    from mp_offload.planner.throughput import step_time

    slow = Machine(adam_rate_per_core=2e6)
    got = [
        step_time(
            ten_b(), 1, slow, batch_per_gpu=2 * b, micro_batch=b,
            accumulate_on_device=accumulate_on_device,
        ).hide_tokens_per_step
        for b in (1, 2, 8)
    ]  # fmt: skip
    assert got[0] > 0 and got == pytest.approx([got[0]] * 3, rel=3e-3)


def test_overlap_is_the_sync_step_without_offload():
    from mp_offload.planner.throughput import step_time

    for mode in ("zero2", "pytorch"):
        st = step_time(ten_b(), 8, Machine(), mode=mode)
        assert st.step_overlap == st.step_sync and st.hide_tokens_per_step == 0.0
    st = step_time(ten_b(), 8, Machine(), offload_fraction=0.0)  # all of it on the device
    assert st.host_exposed == st.host_hidden == st.hide_tokens_per_step == 0.0
    assert st.step_overlap == pytest.approx(st.step_sync)


def _gradients_one_by_one(k, down, accumulate_s, r, on_device, bwd, rs):
    """The gradient terms micro-batch by micro-batch, written out (what the model sums)."""
    from mp_offload.ops.traffic import accumulate_arrays, bytes_per_element

    exposed = acc = last = 0.0
    for i in range(k):
        copy = down if i == k - 1 or not on_device else 0.0
        a = bytes_per_element(accumulate_arrays(r, i == 0)) * accumulate_s
        g = max(0.0, max(rs, copy) - bwd)
        exposed, last = exposed + g, max(0.0, a - bwd - g)
        acc += last
    return exposed, acc, last


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_the_gradient_terms_count_each_micro_batch(k, on_device):
    from mp_offload.planner.throughput import _offload_gradients

    for down, acc_s, bwd, rs in ((3.0, 0.5, 2.0, 1.0), (1.0, 0.0, 2.0, 2.5), (0.5, 0.9, 1.0, 0.2)):
        args = (k, down, acc_s, 2, on_device, bwd, rs)
        assert _offload_gradients(*args) == pytest.approx(_gradients_one_by_one(*args))


def test_a_huge_global_batch_is_priced_without_a_list_per_micro_batch():
    """10^12 micro-batches: the first, the middle and the last are each alike."""
    from mp_offload.planner.throughput import _offload_gradients

    k, terms = 10**12, (3.0, 0.5, 2, False, 2.0, 0.5)
    exposed, acc, last = _offload_gradients(k, *terms)
    three, four = (_gradients_one_by_one(j, *terms) for j in (3, 4))
    assert exposed == pytest.approx(three[0] / 3 * k)  # every micro-batch copies the same
    middle = four[1] - three[1]  # one more micro-batch in the middle
    assert middle > 0 and acc == pytest.approx(three[1] + (k - 3) * middle)
    assert last == pytest.approx(three[2])


def test_pcie_both_ways_at_once_runs_at_the_measured_share_of_one_way():
    from mp_offload.planner.throughput import PCIE_DUPLEX_SHARE

    assert Machine(pcie_gbs=25.0).pcie_each_way_gbs == pytest.approx(25.0 * PCIE_DUPLEX_SHARE)
    assert 11 <= Machine(pcie_gbs=25.0).pcie_each_way_gbs <= 16  # the measured pairs
    assert Machine(pcie_gbs=25.0, pcie_duplex_gbs=13.5).pcie_each_way_gbs == 13.5


def test_the_streamed_gpu_step_is_the_slowest_of_its_pipelined_passes():
    """State of n elements streamed up and back at the both-ways PCIe speed, read and
    written in host memory, and updated at device memory bandwidth: the slowest counts."""
    from mp_offload.planner.throughput import device_adam_bytes, streamed_gpu_step

    n = 10**9
    link = Machine(pcie_gbs=50.0, pcie_duplex_gbs=10.0, host_mem_gbs=1e6, device_mem_gbs=1e6)
    assert streamed_gpu_step(n, 2, (4, 4), False, link, 8) == pytest.approx(12 * n / 10e9)
    # remainders: only the 2-byte remainder of the master travels; bf16 moments 2 + 2
    assert streamed_gpu_step(n, 2, (2, 2), True, link, 8) == pytest.approx(6 * n / 10e9)
    host = Machine(pcie_duplex_gbs=1e6, host_mem_gbs=80.0, device_mem_gbs=1e6)
    assert streamed_gpu_step(n, 2, (4, 4), False, host, 8) == pytest.approx(2 * 12 * n / 10e9)
    dev = Machine(pcie_duplex_gbs=1e6, host_mem_gbs=1e6, device_mem_gbs=1.0)
    assert streamed_gpu_step(n, 2, (4, 4), False, dev, 8) == pytest.approx(
        device_adam_bytes(2) * n / 1e9
    )
