"""planner/overlap_schedule.py: the overlapped host step, bucket by bucket, by hand."""

import pytest

from mp_offload.planner.overlap_schedule import Buckets, buckets, keeping_up_backward, schedule


def _three(work_1: float) -> Buckets:
    """Three host buckets (20%, 30%, 50% of the slice), 1 s down each."""
    return Buckets((0.2, 0.3, 0.5), (True,) * 3, (0.0,) * 3, (1.0,) * 3, (4.0, work_1, 1.0))


def test_schedule_by_hand():
    # backward 10 s: computed at 2, 5, 10; landed at 3, 6, 11; the worker steps bucket 0
    # over [3, 7], bucket 1 over [7, 11.5] (it waited), bucket 2 over [11.5, 12.5]. The end
    # of backward at 11 (the last chunk landed); the worker done at 12.5 (the copies up
    # follow: planner/publish.py).
    got = schedule(_three(4.5), 10.0)
    assert got.exposed == pytest.approx(1.5)
    assert got.hidden == pytest.approx(8.0)
    assert got.keeps_up is False  # bucket 2 landed at 11 with the worker busy until 11.5
    # bucket 1 done at 11: the worker is free as bucket 2 lands
    assert schedule(_three(4.0), 10.0).keeps_up is True


def test_device_share_buckets_skip_the_worker():
    host_only = schedule(_three(4.5), 10.0)
    b = _three(4.5)
    on_device = Buckets(b.share, (False, True, True), b.reduce, b.down, b.work)
    got = schedule(on_device, 10.0)
    # bucket 1 lands at 6 and is stepped over [6, 10.5], bucket 2 over [11, 12]
    assert got.hidden == pytest.approx(4.5) and got.exposed == pytest.approx(1.0)
    assert got.keeps_up and not host_only.keeps_up


def test_buckets_splits_per_element_costs_and_the_device_share():
    b = buckets([10, 30, 60], 2, 2.0, 0.1, 0.01)  # the last bucket on the device
    assert b.share == pytest.approx((0.1, 0.3, 0.6)) and b.host == (True, True, False)
    assert b.reduce == pytest.approx((0.2, 0.6, 1.2))
    assert b.down == pytest.approx((1.0, 3.0, 0.0))
    assert b.work == pytest.approx((0.1, 0.3, 0.0))


def test_keeping_up_backward_is_the_threshold():
    b = _three(4.5)
    t = keeping_up_backward(b, 1.0)
    assert schedule(b, t).keeps_up and not schedule(b, 0.99 * t).keeps_up
    # by hand: bucket 1 ends at max(0.2t + 5, 0.5t + 1) + 4.5, bucket 2 lands at t + 1;
    # below t = 40/3 the first term is the larger: 0.2t + 9.5 <= t + 1 from t = 10.625
    assert t == pytest.approx(10.625, rel=2e-3)
    assert keeping_up_backward(b, 1000.0) == pytest.approx(t, rel=2e-3)  # from above too


def _brute(parts, top):
    costs = [max(parts(j)) for j in range(top + 1)]
    return costs.index(min(costs))


def test_least_exposed_finds_the_crossing_and_the_first_of_equal_costs():
    from mp_offload.planner.fraction import least_exposed

    # device 0.1 j against host 1 - 0.2 j (at least 0.3): 1, .8, .6, .4, .4, .5, ...
    parts = lambda j: (0.1 * j, max(1.0 - 0.2 * j, 0.3))  # noqa: E731
    assert least_exposed(parts, 8) == 3 == _brute(parts, 8)
    assert least_exposed(parts, 2) == 2 and least_exposed(parts, 0) == 0
    # a host plateau with a cheap device: the first bucket count of the plateau
    flat = lambda j: (0.01 * j, 1.0 if j == 0 else 0.5)  # noqa: E731
    assert least_exposed(flat, 5) == 1
    rng = __import__("random").Random(7)
    values = [0.0, 0.5, 1.0, 1.5, 2.0]
    for _ in range(200):  # any non-decreasing device part and non-increasing host part
        top = rng.randrange(0, 12)
        dev = sorted(rng.choice(values) for _ in range(top + 1))
        host = sorted((rng.choice(values) for _ in range(top + 1)), reverse=True)
        pairs = list(zip(dev, host))
        assert least_exposed(pairs.__getitem__, top) == _brute(pairs.__getitem__, top), pairs


def test_plan_with_the_overlap_picks_the_fraction_of_least_exposed_time(capsys, monkeypatch):
    """No F given, --overlap-cpu-optimizer, a device whose memory is slow (its Adam over a
    large share takes longer than the host's exposed work): the plan keeps on the device
    the share whose exposed optimizer time is the smallest of all that fit (checked at
    every boundary), not the largest share that fits, which it keeps without the flag."""

    from planner_cases import plan_out

    from mp_offload.optimizer.split import split_buckets
    from mp_offload.planner.answer import overlap_exposed
    from mp_offload.planner.arguments import _machine, parse, run_from_args
    from mp_offload.planner.fraction import fraction_for, pick_offload_fraction
    from mp_offload.planner.memory import Hardware

    flags = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16"]
    flags += ["--seq-length", "2048", "--micro-batch-size", "4", "--bf16", "--cpu-offload"]
    flags += ["--machine", "hgx-h100", "--world-size", "1", "--device-memory-gb", "24"]
    flags += ["--device-mem-gbs", "30", "--reduce-bucket-size", "20000000"]

    def picked(out):
        line = next(ln for ln in out.splitlines() if ln.startswith("offload fraction:"))
        if "--optimizer-offload-fraction " in line:
            return float(line.split("--optimizer-offload-fraction ")[1].split()[0])
        return float(line.split("offload fraction:")[1].split()[0])  # "1 (all of it ...)"

    code, out = plan_out(capsys, monkeypatch, *flags, "--overlap-cpu-optimizer")
    assert code == 0 and "least exposed optimizer time" in out
    f_overlap = picked(out)
    code, out = plan_out(capsys, monkeypatch, *flags)
    f_sync = picked(out)
    # every boundary that fits, by brute force, on the planner's own run and machine
    from planner_cases import RATE

    args, opt = parse([*RATE, *flags, "--overlap-cpu-optimizer"])
    args.train.dry_run = True
    from mp_offload.config import resolve

    args = resolve(args, 1)
    hw = Hardware(24, opt.host_memory_gb, opt.devices_per_node, host_headroom_gb=0.1 * 2048)
    run = run_from_args(args, 1)
    assert run.options.overlap_cpu_optimizer
    f_fit, plan = pick_offload_fraction(run, hw)
    chunks = plan.ranks[0].shapes.chunks
    top = split_buckets(chunks, f_fit)
    parts = overlap_exposed(run.cfg, run, _machine(opt, hw)[0], opt.batch_per_gpu)
    best = _brute(lambda j: parts(fraction_for(chunks, j)), top)
    assert f_sync == fraction_for(chunks, top)  # without the flag: the largest that fits
    assert split_buckets(chunks, f_overlap) == best < top
    assert not run.at_fraction(0.0).options.overlap_cpu_optimizer  # F = 0: nothing to hide


def test_layout_search_weighs_the_overlap():
    """A layout with --overlap-cpu-optimizer keeps the share of the least exposed time (the
    same pick as the plan's) and is ranked by the overlapped step."""

    from mp_offload.model.gpt import GPTConfig
    from mp_offload.planner.answer import overlap_exposed
    from mp_offload.planner.fraction import pick_offload_fraction
    from mp_offload.planner.memory import Hardware, Run
    from mp_offload.planner.parallel_layout import plan_layout
    from mp_offload.planner.throughput import Machine

    cfg = GPTConfig(
        num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
        vocab_size=50257, recompute_activations=True,
    )  # fmt: skip
    machine = Machine(400, 8, 350, 40, 50, 112, 400, 8e7, 30)  # slow device memory
    hw = Hardware(24, 2048, 8)
    run = Run(cfg, micro_batch=4).with_options(bucket_size=20_000_000, overlap_cpu_optimizer=True)
    lay = plan_layout(run, hw, machine, 1, 1, 16, pick_fraction=True)
    r = run.with_options(micro_batches=4)
    want, _ = pick_offload_fraction(r, hw, overlap_exposed(cfg, r, machine, 16))
    largest, _ = pick_offload_fraction(r, hw)
    assert lay.run.options.offload_fraction == want > largest
    assert lay.tokens_per_second == lay.speed.tokens_per_step / lay.speed.step_overlap
