"""The CUDA checks' parsing on synthetic profiler spans (tests/kernel_timeline.py)."""

from kernel_timeline import (
    Span,
    d2h_overlap_share,
    host_allocated_bytes,
    is_compute,
    is_d2h,
    streams_of,
)


def test_every_kernel_but_copies_and_fills_is_compute():
    for name in (
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT",  # Hopper cuBLAS GEMM
        "sm90_xmma_gemm_bf16bf16_bf16f32",
        "void at::native::vectorized_elementwise_kernel<4, ...>",
        "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel",
    ):
        assert is_compute(name), name
    for name in (
        "Memcpy DtoH (Device -> Pinned)",
        "Memcpy HtoD (Pinned -> Device)",
        "Memset (Device)",
    ):
        assert not is_compute(name), name
    assert is_d2h("Memcpy DtoH (Device -> Pinned)") and not is_d2h("Memcpy HtoD (Pinned -> Device)")


def test_overlap_is_measured_in_time_not_by_stream():
    d2h = "Memcpy DtoH (Device -> Pinned)"
    gemm = "nvjet_tst_128x256"
    # on its own stream but strictly between the kernels: no overlap at all
    serial = [Span(gemm, 7, 0, 10), Span(d2h, 20, 10, 14), Span(gemm, 7, 14, 30)]
    assert streams_of(serial, is_d2h).isdisjoint(streams_of(serial, is_compute))
    assert d2h_overlap_share(serial) == 0.0
    # half of the copy under a kernel of another stream; two kernels overlapping each
    # other count once; a kernel on the copy's own stream does not count
    timeline = [
        Span(d2h, 20, 10, 20),
        Span(gemm, 7, 0, 13),
        Span("elementwise", 7, 12, 15),
        Span("reduce", 20, 15, 20),
        Span(d2h, 20, 30, 40),
        Span(gemm, 9, 35, 50),
    ]
    assert d2h_overlap_share(timeline) == (5 + 5) / 20
    assert d2h_overlap_share([Span(gemm, 7, 0, 1)]) == 0.0


def test_the_host_allocator_key_is_not_the_device_allocators():
    stats = {"allocated_bytes.all.current": 0, "allocated_bytes.current": 4096}
    assert host_allocated_bytes(stats) == 4096
    assert host_allocated_bytes({}) == 0
