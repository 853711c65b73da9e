"""planner/host_forms.py: how much larger a model fits with remainders and with each
moment dtype, as `python -m mp_offload.plan` states it with no flags."""

import re
from dataclasses import replace

import torch

from mp_offload.model.gpt import GPTConfig
from mp_offload.planner import Hardware, Run, plan_job
from mp_offload.planner.host_forms import HOST_FORMS, format_host_form_gains, host_form_gains

BASE = GPTConfig(
    num_layers=1,
    hidden_size=1024,
    num_attention_heads=16,
    seq_length=1024,
    vocab_size=50257,
    recompute_activations=True,
)
U8 = torch.uint8  # 8-bit moments
HW = Hardware(device_memory_gb=16, host_memory_gb=24, devices_per_node=1)  # host-bound, small


def test_each_smaller_form_fits_a_larger_model_and_the_host_bytes_say_why():
    run = Run(BASE).with_options(micro_batches=4)
    plain, gains = host_form_gains(run, HW, "layers", pick_fraction=False)
    got = dict(gains)
    assert [label for label, _ in gains] == [label for label, _ in HOST_FORMS]
    assert plain.limit == "host"
    for label, found in gains:
        assert found.params > plain.params, label
    assert got["remainders + 8-bit moments"].params > got["8-bit moments"].params
    assert got["remainders + bf16 moments"].params > got["bf16 moments"].params
    text = format_host_form_gains(plain, gains)
    assert all(f"{label} {f.params / 1e9:.2f}B" in text for label, f in gains), text
    # the same model with remainders: its host master is half the fp32 one, the rest equal
    fp32 = plan_job(replace(run, cfg=plain.cfg), HW).ranks[0].host
    rem = plan_job(replace(run, cfg=plain.cfg).with_options(store_param_remainders=True), HW)
    rem = rem.ranks[0].host
    assert rem["master"] * 2 == fp32["master"]
    assert {k: v for k, v in rem.items() if k != "master"} == {
        k: v for k, v in fp32.items() if k != "master"
    }
    # a save's transient is a parameter of the weights copied down (the largest bucket
    # bounds it), either way: the remainders' fp32 master goes out a 4 MiB chunk at a time
    bucket = plan_job(replace(run, cfg=plain.cfg), HW).ranks[0].shapes.max_bucket
    assert rem["save"] == fp32["save"] == 2 * bucket
    # and 8-bit moments: one byte per element plus a 4-byte scale per 256
    q8 = replace(run, cfg=plain.cfg).with_options(exp_avg_dtype=U8, exp_avg_sq_dtype=U8)
    q8 = plan_job(q8, HW).ranks[0].host
    assert fp32["exp_avg"] / 4 < q8["exp_avg"] < fp32["exp_avg"] / 4 * (1 + 4 / 256) + 4096


def test_fp32_params_get_the_moment_forms_only():
    fp32 = Run(BASE).with_options(dtype=torch.float32)
    _, gains = host_form_gains(fp32, HW, "layers", pick_fraction=False)
    assert [label for label, _ in gains] == ["bf16 moments", "8-bit moments"]


def test_the_plan_with_no_flags_states_the_gains(capsys):
    from mp_offload.plan import main

    assert main(["--adam-rate-per-core", "8e7"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("smaller host state"))
    for label, _ in HOST_FORMS:
        assert re.search(re.escape(label) + r" \d+\.\d\dB \([+-]\d+%", line), (label, line)
    plain = float(re.search(r"largest GPT is (\d+\.\d\d)B", line).group(1))
    rem = float(re.search(r"--store-param-remainders (\d+\.\d\d)B", line).group(1))
    assert rem > plain


def test_the_launch_line_keeps_the_host_state_flags():
    """The command the planner prints trains what it planned: the moment dtypes and
    remainders (offload's forms) are on it, and the flags pass the run's checks."""
    from mp_offload.config import config_problems, parse_args
    from mp_offload.planner.answer import _host_state_flags

    run = Run(BASE).with_options(
        exp_avg_dtype=U8, exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=True
    )
    flags = _host_state_flags(run)
    assert flags == [
        "--exp-avg-dtype",
        "8bit",
        "--exp-avg-sq-dtype",
        "bf16",
        "--store-param-remainders",
    ]
    argv = ["--train-iters", "1", "--bf16", "--cpu-offload", *flags]
    assert config_problems(parse_args(argv), 1) == []
    assert _host_state_flags(replace(run, mode="zero2")) == ["--exp-avg-sq-dtype", "bf16"]
    assert _host_state_flags(Run(BASE)) == []
