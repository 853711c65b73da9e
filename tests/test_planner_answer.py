"""planner/answer.py: the answer to "what fits here, how fast" and the launch command."""

import dataclasses

import pytest
from helpers import tiny_gpt_config
from planner_cases import plan_out

from mp_offload.model.gpt import GPTConfig
from mp_offload.planner import (
    Hardware,
    Run,
    max_model,
)
from mp_offload.planner.throughput import Machine


def _table(out):
    """{mode: (billions, limit, tokens/day text, days per 1B tokens)} of the mode table."""
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if (
            line.startswith("  ")
            and parts
            and parts[0].rstrip(":") in ("offload", "zero2", "pytorch")
        ):
            billions = next(
                p for p in parts if p.endswith("B") and p[:-1].replace(".", "").isdigit()
            )
            i = parts.index(billions)
            rows[parts[0].rstrip(":")] = (
                float(billions[:-1]),
                parts[i + 2],
                parts[-2],
                float(parts[-1]),
            )
    return rows


def test_no_flags_answers_for_the_launch_scripts_defaults(capsys, monkeypatch):
    """bf16 + offload + recompute + seq 2048 on one 80 GiB GPU with 256 GiB host, 10% of it
    kept free; every mode side by side; time from the throughput model; the command."""
    from mp_offload.planner.answer import speed
    from mp_offload.planner.search import paper_base

    code, out = plan_out(capsys, monkeypatch)
    assert code == 0
    assert out.startswith("planning bf16, ZeRO-Offload (--cpu-offload), recompute on, seq 2048")
    assert (
        "assumed (the launch scripts' defaults; give the flag to change it): --bf16 "
        "--cpu-offload --recompute-activations --seq-length 2048 --vocab-size 50257" in out
    )
    assert "host 256 GiB per node with 25.6 GiB kept free" in out
    # The figures, recomputed: the largest offload model, keeping on the device the share
    # of its optimizer state that fits there (no --optimizer-offload-fraction given), fits
    # in 230.4 GiB of host; one layer more does not fit at any F. Full offload is smaller.
    from mp_offload.planner.fraction import pick_offload_fraction

    base = dataclasses.replace(paper_base(seq=2048), recompute_activations=True)
    hw = Hardware(80, 256, 8, host_headroom_gb=25.6)
    run = Run(base, micro_batch=4).with_options(micro_batches=4)  # 16 sequences: 4 micro-batches
    found = max_model(run, hw, pick_fraction=True)
    assert found.limit == "host" and found.plan.host_node_peak <= 230.4 * 2**30
    more = dataclasses.replace(found.cfg, num_layers=found.cfg.num_layers + 1)
    assert not pick_offload_fraction(dataclasses.replace(run, cfg=more), hw)[1].fits
    assert 11.5e9 < max_model(run, hw).params < 12.5e9 < found.params < 16e9
    run = found.plan.run
    from mp_offload.optimizer.split import split_buckets

    printed = float(out.split("--optimizer-offload-fraction ")[1].split()[0])
    chunks = found.plan.ranks[0].shapes.chunks  # the printed F splits where the plan did
    assert split_buckets(chunks, printed) == split_buckets(chunks, run.options.offload_fraction)
    c = found.cfg
    assert (
        f"max model (gpt3), offload: {found.params / 1e9:.2f}B = --num-layers "
        f"{c.num_layers} --hidden-size {c.hidden_size}" in out
    )
    rows = _table(out)
    assert set(rows) == {"offload", "zero2", "pytorch"}
    assert rows["offload"][:2] == (round(found.params / 1e9, 2), "host")
    assert rows["zero2"][1] == rows["pytorch"][1] == "device"
    assert rows["offload"][0] > 2 * rows["zero2"][0]  # one GPU: offload wins by far
    assert "fits a LARGER model" not in out
    st = speed(
        c, dataclasses.replace(run, cfg=c), Machine(devices_per_node=8, adam_rate_per_core=8e7), 16
    )
    assert st.tokens_per_step == 16 * 2048
    assert rows["offload"][3] == round(st.days_per_billion_tokens, 1)
    assert f"{st.step_sync:.2f} s per step of 32,768 tokens" in out
    assert "days per 1B tokens" in out and "tokens/day" in out
    launch = out[out.index("launch (this node;") :]
    assert "torchrun --standalone --nproc-per-node 1 pretrain_gpt.py" in launch
    assert (
        f"--num-layers {c.num_layers} --hidden-size {c.hidden_size} "
        f"--num-attention-heads {c.num_attention_heads}" in launch
    )
    assert (
        "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 "
        "--global-batch-size 16" in launch
    )
    assert (
        f"--bf16 --cpu-offload --optimizer-offload-fraction {printed:g} --recompute-activations"
    ) in launch
    assert f"--train-iters {-(-(10**9) // (16 * 2048))}" in launch


def test_two_nodes_of_eight_say_no_offload_fits_more(capsys, monkeypatch):
    """2 x 8 GPUs, TP=8 x DP=2, 512 GiB hosts: offload is host-bound (10 bytes per
    parameter per node) and leaves 10% free; ZeRO-2 without offload fits more than full
    offload (F=1 given); with no F given, offload keeps the share that fits on the device
    and is never smaller than ZeRO-2 (F=0 is ZeRO-2)."""
    code, out = plan_out(
        capsys,
        monkeypatch,
        "--world-size",
        "16",
        "--host-memory-gb",
        "512",
        "--tensor-model-parallel-size",
        "8",
        "--optimizer-offload-fraction",
        "1",
    )
    assert code == 0
    rows = _table(out)
    assert rows["offload"][1] == "host" and rows["zero2"][1] == "device"
    assert rows["zero2"][0] > 1.15 * rows["offload"][0]
    assert (
        f"note: ZeRO-2, no offload fits a LARGER model on this hardware: "
        f"{rows['zero2'][0]:.2f}B vs {rows['offload'][0]:.2f}B (offload is limited by host "
        f"memory here); plan it with --no-cpu-offload" in out
    )
    host = float(out.split("host per node: ")[1].split()[0])
    assert host <= 460.8  # 512 less the 10% headroom, not 503.8
    assert (
        'torchrun --nnodes 2 --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" '
        "--master-port 29500 --nproc-per-node 8 pretrain_gpt.py" in out
    )
    assert "--tensor-model-parallel-size 8" in out and "--global-batch-size 32" in out
    # No headroom: a larger offload model, filling the host to the brim.
    code, out0 = plan_out(
        capsys,
        monkeypatch,
        "--world-size",
        "16",
        "--host-memory-gb",
        "512",
        "--tensor-model-parallel-size",
        "8",
        "--host-headroom-gb",
        "0",
        "--optimizer-offload-fraction",
        "1",
    )
    assert _table(out0)["offload"][0] > rows["offload"][0]
    assert 460.8 < float(out0.split("host per node: ")[1].split()[0]) <= 512
    # Without offload asked for, the answer and the command are for ZeRO-2.
    code, out2 = plan_out(
        capsys,
        monkeypatch,
        "--world-size",
        "16",
        "--host-memory-gb",
        "512",
        "--tensor-model-parallel-size",
        "8",
        "--no-cpu-offload",
    )
    assert f"max model (gpt3), zero2: {rows['zero2'][0]:.2f}B" in out2
    assert "fits a LARGER model" not in out2 and "--cpu-offload" not in out2.split("launch (")[1]
    code, out3 = plan_out(
        capsys,
        monkeypatch,
        "--world-size",
        "16",
        "--host-memory-gb",
        "512",
        "--tensor-model-parallel-size",
        "8",
    )
    picked = _table(out3)
    assert picked["offload"][0] >= picked["zero2"][0] > rows["offload"][0]
    assert "fits a LARGER model" not in out3 and "--optimizer-offload-fraction" in out3


@pytest.mark.parametrize(
    "preset,extra",
    [
        ("llama3-8b", []),
        (
            "llama2-70b",
            ["--tensor-model-parallel-size", "8", "--world-size", "8", "--sequence-parallel"],
        ),
    ],
)
def test_printed_launch_command_trains_the_named_model(preset, extra, capsys):
    """The torchrun line the planner prints for --model NAME parses back to that model:
    every option (RMSNorm, SwiGLU, rope base, GQA, untied, no bias) is on it."""
    import shlex

    from mp_offload.config import parse_args
    from mp_offload.plan import main as plan_main
    from mp_offload.planner.named_models import MODEL_PRESETS

    assert plan_main(["--model", preset, "--machine", "hgx-h200", *extra]) == 0
    out = capsys.readouterr().out
    cmd = out[out.index("torchrun") :].replace("\\\n", " ")
    words = shlex.split(cmd.split("\n")[0])
    flags = words[words.index("pretrain_gpt.py") + 1 :]
    flags = ["x" if w.startswith("$") else w for w in flags]
    got = parse_args(
        flags
        + ["--vocab-size", MODEL_PRESETS[preset][MODEL_PRESETS[preset].index("--vocab-size") + 1]]
    ).model
    want = parse_args(MODEL_PRESETS[preset] + extra[:2] + extra[4:]).model
    for field in (
        "sequence_parallel",
        "normalization",
        "swiglu",
        "position_embedding_type",
        "rotary_base",
        "group_query_attention",
        "num_query_groups",
        "untie_embeddings_and_output_weights",
        "disable_bias_linear",
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
    ):
        assert getattr(got, field) == getattr(want, field), field


def test_model_flags_leave_default_options_out_and_name_each_once():
    from mp_offload.model.gpt_config import model_flags

    base = GPTConfig(**tiny_gpt_config())
    assert "--layernorm-epsilon" not in model_flags(base)
    flags = model_flags(dataclasses.replace(base, layernorm_epsilon=1e-6))
    assert flags.count("--layernorm-epsilon") == 1
    assert flags[flags.index("--layernorm-epsilon") + 1] == "1e-06"


@pytest.mark.parametrize("micro,kept_up", [(4, True), (1, False)])
def test_plan_prints_the_overlapped_step_and_where_it_hides(micro, kept_up, capsys, monkeypatch):
    """An offload plan prints the throughput model's overlapped step for the user's machine
    and the tokens per step from which the CPU Adam keeps up with backward (1.3B on an HGX
    H100 node: a micro-batch of 4 keeps up, one of 1 does not)."""
    import math

    from mp_offload.planner.answer import speed
    from mp_offload.planner.memory import Run

    shape = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16"]
    flags = [*shape, "--seq-length", "2048", "--micro-batch-size", str(micro), "--bf16"]
    flags += ["--cpu-offload", "--optimizer-offload-fraction", "1", "--recompute-activations"]
    flags += ["--machine", "hgx-h100", "--world-size", "1", "--batch-per-gpu", str(4 * micro)]
    code, out = plan_out(capsys, monkeypatch, *flags)
    assert code == 0
    line = next(ln for ln in out.splitlines() if "with --overlap-cpu-optimizer" in ln)
    cfg = GPTConfig(
        num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
        vocab_size=50257, recompute_activations=True,
    )  # fmt: skip
    m = Machine(400, 8, 350, 40, 50, 112, 400, 8e7, 3350)  # the preset's, RATE's Adam
    st = speed(cfg, Run(cfg, micro_batch=micro).with_options(micro_batches=4), m, 4 * micro)
    assert f"{st.step_overlap:.2f} s per step ({st.step_sync / st.step_overlap:.2f}x)" in line
    assert (st.hide_tokens_per_step <= st.tokens_per_step) is kept_up
    if kept_up:  # the CPU Adam hides under backward: faster than the synchronous step
        assert "already at these" in line and st.step_overlap < st.step_sync
    else:
        need = math.ceil(st.hide_tokens_per_step / (4 * 2048))
        assert f"from {st.hide_tokens_per_step:,.0f} tokens per step" in line
        assert f"--micro-batch-size >= {need} " in line


def _main(capsys, monkeypatch, *argv) -> tuple[int, str]:
    """The plan command line as given: no rate added (plan_out gives one)."""
    from mp_offload.plan import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main(list(argv))
    return code, capsys.readouterr().out


H200_7B = ["--model", "llama2-7b", "--global-batch-size", "4"]
ONE_H200 = ["--device-memory-gb", "139.8", "--host-memory-gb", "128", "--devices-per-node", "1"]


@pytest.mark.parametrize("machine", [["--machine", "h200"], ONE_H200])
def test_the_commands_global_batch_is_priced(capsys, monkeypatch, machine):
    """7B on one H200 with --global-batch-size 4 at seq 4096: 16,384 tokens a step."""
    code, out = plan_out(capsys, monkeypatch, *H200_7B, *machine)
    assert code == 0
    assert "per step of 16,384 tokens (4096 per sequence)" in out
    assert "per step 16,384 tokens = " in out  # the description says the same
    assert "wall time for 1,000,000,000 tokens: 61,036 iterations" in out  # 1e9 / 16,384
    launch = out[out.index("torchrun") :]
    assert "--micro-batch-size 4 --global-batch-size 4 " in launch


def test_a_global_batch_and_a_batch_per_gpu_exclude_each_other(capsys, monkeypatch):
    from mp_offload.plan import main

    code = main([*H200_7B, "--batch-per-gpu", "8"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("plan: error: --batch-per-gpu excludes --global-batch")


def test_the_overlap_is_advised_only_when_its_second_state_copy_fits(capsys, monkeypatch):
    """All of 7B's optimizer state on the host: 128 GiB holds one copy, not the overlap's
    two; 512 GiB holds both."""
    from mp_offload.planner.arguments import parse
    from mp_offload.planner.memory import plan_job
    from mp_offload.planner.report import overlap_fits

    whole = ["--optimizer-offload-fraction", "1"]
    code, small = plan_out(capsys, monkeypatch, "--machine", "h200", *H200_7B, *whole)
    assert code == 0 and "-> fits" in small and "DOES NOT FIT" not in small
    assert "with --overlap-cpu-optimizer" not in small
    big = ["--host-memory-gb", "512"]
    code, out = plan_out(capsys, monkeypatch, "--machine", "h200", *H200_7B, *whole, *big)
    assert code == 0 and "  with --overlap-cpu-optimizer: " in out
    # the reason, from the plan itself: the overlap's host state does not fit 128 GiB
    from mp_offload.config import resolve
    from mp_offload.planner.arguments import run_from_args
    from mp_offload.planner.cli import _hardware

    args, opt = parse(["--machine", "h200", *H200_7B, *whole])
    args.train.dry_run = True
    run, hw = run_from_args(resolve(args, 1), 1), _hardware(opt)
    assert plan_job(run, hw).fits and not overlap_fits(run, hw)
    assert not plan_job(run.with_options(overlap_cpu_optimizer=True), hw).fits_host


def test_the_same_question_gets_the_same_answer_on_an_idle_and_a_busy_machine(capsys, monkeypatch):
    """The CPU Adam is priced at the named machine's rate: whatever this machine measures
    (an idle one fast, a busy one slow) changes nothing."""
    from mp_offload.planner import arguments, report, throughput

    outs = []
    for here in (5e9, 1e7):  # elements/s this machine would measure, idle and busy
        for module in (throughput, arguments, report):
            monkeypatch.setattr(
                module, "measure_adam_rate", lambda *a, here=here, **k: here, raising=False
            )
        code, out = _main(capsys, monkeypatch, "--machine", "hgx-h100", "--model", "llama2-13b")
        assert code == 0
        outs.append(out)
    assert outs[0] == outs[1]
    assert "CPU Adam 1000 M elements/s per core (stated for --machine hgx-h100)" in outs[0]
    assert "measured" not in outs[0]


def test_each_plan_sets_the_cpu_adam_beside_a_gpu_step_on_streamed_state(capsys, monkeypatch):
    """Qwen3-14B on 8 H200s (the rival's setting, all of the state on the host): the
    streamed GPU step against this code's CPU Adam, priced from the same machine."""
    argv = ["--machine", "hgx-h200", "--model", "qwen3-14b", "--optimizer-offload-fraction", "1"]
    argv += ["--global-batch-size", "64", "--tensor-model-parallel-size", "1"]
    code, out = _main(capsys, monkeypatch, *argv)
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("  CPU Adam or a GPU step"))
    n = 14_768_296_960 // 8  # each rank's slice (no padding at this shape)
    # 12 B an element each way at 0.54 x 50 GB/s, or twice that through the rank's eighth
    # of 400 GB/s of host memory: the host is the slower here
    gpu = max(12 * n / (0.54 * 50e9), 2 * 12 * n / (400e9 / 8))
    got = float(line.split("both at once) ")[1].split(" s")[0])
    assert got == pytest.approx(gpu, abs=2e-3) and "27 GB/s per direction" in line
    cpu = float(line.split("copies up take ")[1].split(" s")[0])
    assert cpu > got
    assert line.endswith(
        f"the GPU step on streamed state is {cpu / got:.2f}x faster on this machine"
    )
    # one H200 on the lent machine's PCIe: 7B's CPU Adam wins there
    whole = ["--optimizer-offload-fraction", "1"]
    code, out = _main(capsys, monkeypatch, "--machine", "h200", *H200_7B, *whole)
    line = next(x for x in out.splitlines() if x.startswith("  CPU Adam or a GPU step"))
    assert "; the CPU Adam is " in line and "13.5 GB/s per direction" in line
