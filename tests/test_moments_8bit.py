"""8-bit Adam moments in the ZeRO optimizer (--exp-avg-dtype/--exp-avg-sq-dtype 8bit):
Blockwise8 host buffers whose blocks restart at each Adam piece, checkpoints holding fp32
moments, exact resume, and one clear error where the state is not all on the host."""

import pytest
import torch
from dist_helpers import ckpt_run, stable_records
from zero_helpers import bf16_offload, host_tensor, state_cat, train

from mp_offload.config import config_problems, parse_args
from mp_offload.ops.cpu_adam import Q8_BLOCK, dequantize_8bit
from mp_offload.optimizer import placement as placement_mod
from mp_offload.optimizer.host_state import Q8Moment

U8, BF16 = torch.uint8, torch.bfloat16
Q8 = dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8, bucket_size=700)  # several pieces


def test_the_placement_block_is_the_kernels():
    assert placement_mod.Q8_BLOCK == Q8_BLOCK


@pytest.mark.parametrize("remainders", [False, True])
def test_blocks_restart_at_each_piece_and_the_bytes_are_placed(remainders):
    _, opt = bf16_offload(remainders, **Q8)
    pieces = [(p.lo, p.n) for p in opt.host_side.pieces]
    assert len(pieces) > 3 and any(n % Q8_BLOCK for _, n in pieces)
    for key in ("exp_avg", "exp_avg_sq"):
        q = host_tensor(opt, key)
        assert isinstance(q, Q8Moment)
        assert sorted(q.pieces) == sorted(h for h, _ in pieces)
        for h, n in pieces:
            piece = q[h : h + n]
            assert piece.codes.numel() == n and piece.scales.numel() == -(-n // Q8_BLOCK)
    n = opt.layout.slice_numel
    scales = sum(-(-c // Q8_BLOCK) for _, c in pieces)
    host = opt.memory_bytes()["host"]
    assert host["exp_avg"] == host["exp_avg_sq"] == n + 4 * scales
    assert host == opt.placement.bytes("host")
    assert host["master"] == (2 if remainders else 4) * n


@pytest.mark.parametrize("remainders", [False, True])
def test_trains_near_fp32_moments_and_saves_fp32(remainders):
    m8, o8 = bf16_offload(remainders, **Q8)
    mf, of = bf16_offload(remainders, bucket_size=700)
    l8, lf = train(m8, o8, 10), train(mf, of, 10)
    assert l8[-1] < l8[0] - 0.2
    worst = max(abs(a - b) / b for a, b in zip(l8, lf))
    assert worst < 0.01, f"8-bit moments stray {worst:.4f} from fp32 moments"
    state = o8.state_dict()
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert state[key].dtype == torch.float32
    q = host_tensor(o8, "exp_avg_sq")
    want = dequantize_8bit(q[0 : q.pieces[0].codes.numel()], "exp_avg_sq")
    assert torch.equal(state["exp_avg_sq"][: want.numel()], want)


@pytest.mark.parametrize("remainders", [False, True])
def test_exact_resume_is_bitwise(remainders):
    mu, unbroken = bf16_offload(remainders, **Q8)
    want = train(mu, unbroken, 6)
    ms, saver = bf16_offload(remainders, **Q8)
    train(ms, saver, 3)
    ml, loader = bf16_offload(remainders, **Q8)
    loader.load_state_dict(saver.state_dict())
    assert train(ml, loader, 3, first=3) == want[3:]
    assert torch.equal(loader.flat, unbroken.flat)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(state_cat(loader, key), state_cat(unbroken, key)), key


def test_a_load_gives_back_the_saved_codes():
    ms, saver = bf16_offload(False, **Q8)
    train(ms, saver, 3)
    _, loader = bf16_offload(False, **Q8)
    loader.load_state_dict(saver.state_dict())
    for key in ("exp_avg_sq", "exp_avg"):
        pairs = zip(
            host_tensor(saver, key).pieces.values(), host_tensor(loader, key).pieces.values()
        )
        for a, b in pairs:
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales), key


def test_checkpoints_load_into_any_moment_dtype():
    """fp32 moments in the file: 8-bit <-> fp32/bf16 moments load both ways."""
    ms, saver = bf16_offload(False, **Q8)
    train(ms, saver, 3)
    state = saver.state_dict()
    _, fp32 = bf16_offload(False, bucket_size=700)
    fp32.load_state_dict(state)
    assert torch.equal(host_tensor(fp32, "exp_avg"), state["exp_avg"])
    _, q8 = bf16_offload(False, **dict(Q8, exp_avg_sq_dtype=BF16))
    q8.load_state_dict(fp32.state_dict())
    assert torch.equal(q8.state_dict()["exp_avg"], state["exp_avg"])  # re-quantized alike


def test_eight_bit_needs_the_whole_state_on_the_host():
    for flags in ([], ["--cpu-offload", "--optimizer-offload-fraction", "0.5"]):
        for flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype"):
            args = parse_args(["--train-iters", "1", "--bf16", flag, "8bit", *flags])
            problems = config_problems(args, 1)
            assert len(problems) == 1 and problems[0].startswith(f"{flag} 8bit needs"), problems
    for kw in (dict(cpu_offload=False), dict(offload_fraction=0.5)):
        with pytest.raises(ValueError, match="--exp-avg-dtype 8bit needs --cpu-offload"):
            bf16_offload(False, exp_avg_dtype=U8, **kw)
    args = parse_args(["--train-iters", "1", "--cpu-offload", "--exp-avg-dtype", "8bit"])
    assert config_problems(args, 1) == []


@pytest.mark.slow
@pytest.mark.parametrize("remainders", [False, True])
def test_tp2_dp2_exact_resume_with_8bit_moments(tmp_path, remainders):
    flags = ["--bf16", "--exp-avg-dtype", "8bit", "--exp-avg-sq-dtype", "8bit"]
    flags += ["--store-param-remainders"] if remainders else []
    unbroken, log, ck = (str(tmp_path / f) for f in ("unbroken.jsonl", "log.jsonl", "ckpt"))
    ckpt_run(4, 2, "--log-json", unbroken, *flags)
    ckpt_run(4, 2, "--save", ck, "--exit-interval", "4", "--log-json", log, *flags)
    ckpt_run(4, 2, "--load", ck, "--log-json", log, *flags)
    assert stable_records(log, True) == stable_records(unbroken, True)


def test_the_planner_keeps_8bit_moments_on_the_host():
    """The fraction search offers no device share to 8-bit moments (the device Adam has
    none) and says why; fp32 moments of the same small model go to the device."""
    from helpers import tiny_gpt_config

    from mp_offload.model.gpt import GPTConfig
    from mp_offload.planner import Hardware, Run
    from mp_offload.planner.fraction import pick_offload_fraction
    from mp_offload.planner.report import _fraction_line

    run, hw = Run(GPTConfig(**tiny_gpt_config())).with_options(bucket_size=700), Hardware()
    assert pick_offload_fraction(run, hw)[0] == 0.0  # all of it fits the device
    q8 = run.with_options(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    assert pick_offload_fraction(q8, hw)[0] == 1.0
    kept, line = _fraction_line(q8, hw)
    assert kept.options.offload_fraction == 1.0 and "8-bit moments live on the host only" in line
