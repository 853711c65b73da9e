"""The planner's answer to "what can I train on this hardware, and how long will it take?".

``compare_max_models`` finds the largest GPT for each mode (ZeRO-Offload, ZeRO-2 without
offload, plain data-parallel AdamW) on the same hardware, so the answer says when leaving
offload off fits a larger model (offload is bound by host memory, 20 bytes per parameter
per node's share; without it the device memory of every GPU counts). ``speed`` puts the
throughput model (``throughput.step_time``) on a found model: tokens per day and days
per billion tokens. ``launch_command`` is the torchrun command line that trains it.
"""

from __future__ import annotations

import functools
import math
import shlex
from dataclasses import dataclass, replace

import torch

from ..model.gpt_config import OPTION_FIELDS, GPTConfig, model_flags
from ..optimizer.options import MOMENT_DTYPES
from .memory import MODES, GiB, Hardware, JobPlan, Run, moment_bytes
from .search import Found, max_model
from .throughput import Machine, StepTime, step_time, streamed_state_bytes

MODE_LABELS = {
    "offload": "ZeRO-Offload (--cpu-offload)",
    "zero2": "ZeRO-2, no offload",
    "pytorch": "plain AdamW (no ZeRO)",
    "pytorch-o2": "apex O2 (20 B/param)",
}
TRAIN_TOKENS = 1e9  # the launch command trains for this many tokens


@dataclass
class ModeAnswer:
    mode: str
    found: Found
    speed: StepTime | None  # None: nothing fits


def speed(cfg: GPTConfig, run: Run, machine: Machine, batch_per_gpu: int) -> StepTime:
    """The throughput model's step for ``cfg`` laid out as ``run``."""
    mode = run.mode if run.mode in MODES else "pytorch"
    o = run.options
    return step_time(
        cfg,
        run.world,
        machine,
        tp=run.tp,
        batch_per_gpu=batch_per_gpu,
        micro_batch=run.micro_batch,
        elem_bytes=o.dtype.itemsize,
        bucket_size=o.bucket_size,
        mode=mode,
        offload_fraction=o.offload_fraction,
        accumulate_on_device=o.accumulate_on_device,
        moment_bytes=moment_bytes(o),
        reduce_bytes=None if o.reduce_dtype is None else o.reduce_dtype.itemsize,
        remainders=o.store_param_remainders,
    )


def overlap_exposed(cfg: GPTConfig, run: Run, machine: Machine, batch_per_gpu: int):
    """``parts(F)``: the overlapped step's exposed optimizer seconds at offload fraction F,
    (the device share's Adam, the host's after backward): what ``pick_offload_fraction``
    weighs with --overlap-cpu-optimizer."""

    @functools.cache
    def parts(f: float) -> tuple[float, float]:
        st = speed(cfg, run.at_fraction(f), machine, batch_per_gpu)
        return st.adam_device, st.host_exposed

    return parts


def compare_max_models(
    run: Run,
    hw: Hardware,
    family: str,
    machine: Machine,
    batch_per_gpu: int,
    pick_fraction: bool = False,
) -> dict[str, ModeAnswer]:
    """The largest GPT of ``family`` in each mode (``run``'s own first), with its speed;
    ``pick_fraction``: offload keeps on the device the optimizer share that fits there."""
    out = {}
    # The launch command accumulates batch_per_gpu / micro_batch micro-batches per step:
    # plan their memory (with offload, an fp32 gradient sum on the host).
    k = max(1, batch_per_gpu // run.micro_batch)
    for mode in dict.fromkeys([run.mode, *MODES]):
        r = replace(run, mode=mode).with_options(micro_batches=k)
        found = max_model(r, hw, family, pick_fraction=pick_fraction)
        if found.plan is not None:
            r = r.at_fraction(found.plan.run.options.offload_fraction)
        out[mode] = ModeAnswer(
            mode, found, speed(found.cfg, r, machine, batch_per_gpu) if found.cfg else None
        )
    return out


def _days(st: StepTime) -> str:
    days = st.days_per_billion_tokens
    return f"{days:.1f}" if days < 100 else f"{days:,.0f}"


def _tokens(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_max_models(answers: dict[str, ModeAnswer]) -> str:
    lines = [
        f"  {'mode':<38}{'largest':>9}  {'shape LxH/heads':<16}{'limited by':<13}"
        f"{'device GiB':>11}{'host GiB/node':>15}{'tokens/day':>12}{'days/1B tok':>13}"
    ]
    for mode, a in answers.items():
        f = a.found
        if f.cfg is None:
            lines.append(f"  {mode + ': ' + MODE_LABELS[mode]:<38}{'-':>9}  nothing fits")
            continue
        c = f.cfg
        lines.append(
            f"  {mode + ': ' + MODE_LABELS[mode]:<38}{f.params / 1e9:8.2f}B  "
            f"{f'{c.num_layers}x{c.hidden_size}/{c.num_attention_heads}':<16}"
            f"{f.limit:<13}{f.plan.device_peak / GiB:11.1f}"
            f"{f.plan.host_node_peak / GiB:15.1f}"
            f"{_tokens(a.speed.tokens_per_day):>12}{_days(a.speed):>13}"
        )
    return "\n".join(lines)


def larger_elsewhere(answers: dict[str, ModeAnswer], mode: str) -> str | None:
    """A sentence when another mode fits a larger model than ``mode`` does, else None."""
    mine = answers[mode].found.params
    best = max(answers.values(), key=lambda a: a.found.params)
    if best.mode == mode or best.found.params <= mine * 1.01:
        return None
    why = (
        f"{mode} is limited by {answers[mode].found.limit} memory here"
        if answers[mode].found.cfg
        else f"nothing fits with {mode}"
    )
    if mode == "offload":
        flag = "--no-cpu-offload" if best.mode == "zero2" else "--optimizer torch-adamw"
    else:
        flag = (
            "--cpu-offload"
            if best.mode == "offload"
            else "--no-cpu-offload"
            if best.mode == "zero2"
            else "--optimizer torch-adamw"
        )
    return (
        f"note: {MODE_LABELS[best.mode]} fits a LARGER model on this hardware: "
        f"{best.found.params / 1e9:.2f}B vs {mine / 1e9:.2f}B ({why}); plan it with {flag}"
    )


def format_split_gain(st: StepTime, full: StepTime) -> str:
    """Partial offload against full offload: the optimizer phase and the step."""
    return (
        f"  optimizer at offload fraction {st.offload_fraction:.4f} (actual): CPU Adam "
        f"{st.adam_host:.3f} s over the host part beside device Adam {st.adam_device:.3f} s "
        f"over the device share -> {st.adam:.3f} s (all offloaded: CPU Adam "
        f"{full.adam:.3f} s); step {st.step_sync:.2f} s vs {full.step_sync:.2f} s "
        f"({full.step_sync / st.step_sync:.2f}x)"
    )


def format_speed(st: StepTime, cfg: GPTConfig, machine: Machine, rate_source: str) -> str:
    host = (
        f", PCIe {machine.pcie_gbs:g} GB/s one way ({machine.pcie_each_way_gbs:.3g} each way "
        f"when both run), host {machine.host_mem_gbs:g} GB/s and "
        f"{machine.cpu_cores_per_node} cores per node, CPU Adam "
        f"{machine.adam_rate_per_core / 1e6:.0f} M elements/s per core ({rate_source})"
        if st.mode == "offload"
        else f", device memory {machine.device_mem_gbs:g} GB/s"
    )
    return (
        f"time ({st.mode}, throughput model): {st.step_sync:.2f} s per step of "
        f"{st.tokens_per_step:,} tokens ({cfg.seq_length} per sequence) = "
        f"{_tokens(st.tokens_per_day)} tokens/day, {_days(st)} days per 1B tokens; "
        f"TFLOPS/GPU {st.tflops_sync:.1f}\n"
        f"  assumes {machine.device_tflops:g} TFLOPS sustained per device, DP links "
        f"{machine.intra_node_gbs:g} GB/s in a node / {machine.inter_node_gbs:g} GB/s per "
        f"GPU across nodes{host} (set --device-tflops, --pcie-gbs, ... for your machine)"
    )


def format_streamed(st: StepTime, run: Run, machine: Machine) -> str:
    """This code's CPU Adam step beside a GPU step on the same state streamed from the
    host and back, and which is faster on this machine."""
    cpu = st.step_sync - st.step_streamed + st.streamed  # its Adam and its copies' wait
    o = run.options
    state = streamed_state_bytes(moment_bytes(o), o.store_param_remainders)
    faster = "the CPU Adam" if cpu <= st.streamed else "the GPU step on streamed state"
    ratio = max(cpu, st.streamed) / min(cpu, st.streamed) if min(cpu, st.streamed) else 1.0
    return (
        f"  CPU Adam or a GPU step on streamed state: the CPU Adam and the forward's wait "
        f"for its copies up take {cpu:.3f} s after backward; an Adam on the GPU over the "
        f"host's state streamed up and back ({state} B an element each way at "
        f"{machine.pcie_each_way_gbs:.3g} GB/s per direction, both at once) "
        f"{st.streamed:.3f} s: step {st.step_sync:.2f} s vs {st.step_streamed:.2f} s; "
        f"{faster} is {ratio:.2f}x faster on this machine"
    )


def format_overlap(st: StepTime, micro_batch: int) -> str:
    """The step with --overlap-cpu-optimizer and the tokens per step (the micro-batch grown,
    the micro-batch count kept) from which its host worker keeps up with backward."""
    per_sequence = st.tokens_per_step / micro_batch  # tokens per step per sequence of it
    need = math.ceil(st.hide_tokens_per_step / per_sequence)
    where = (
        f"already at these {st.tokens_per_step:,} tokens per step"
        if st.hide_tokens_per_step <= st.tokens_per_step
        else f"from {st.hide_tokens_per_step:,.0f} tokens per step (--micro-batch-size "
        f">= {need} at this micro-batch count and DP)"
    )
    return (
        f"  with --overlap-cpu-optimizer: {st.step_overlap:.2f} s per step "
        f"({st.step_sync / st.step_overlap:.2f}x); host work {st.host_hidden:.3f} s under "
        f"the last backward, {st.host_exposed:.3f} s after it (the CPU Adam left and the "
        f"forward's wait for the copies up); the CPU Adam keeps up with the arriving "
        f"gradients {where}"
    )


def duration(seconds: float) -> str:
    """A wall time as a person reads it: minutes, hours, or days and hours."""
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} hours"
    days, hours = divmod(round(seconds / 3600), 24)
    return f"{days:,} days {hours} hours"


def format_wall_time(tokens: float, st: StepTime, priced_for: str) -> str:
    """How long ``tokens`` take at the throughput model's step time."""
    iters = math.ceil(tokens / st.tokens_per_step)
    return (
        f"wall time for {tokens:,.0f} tokens: {iters:,} iterations x {st.step_sync:.2f} s "
        f"= {duration(iters * st.step_sync)} ({st.tokens_per_step / st.step_sync:,.0f} "
        f"tokens/s; throughput model, {priced_for})"
    )


def launch_command(
    cfg: GPTConfig,
    run: Run,
    plan: JobPlan,
    st: StepTime,
    precision: str,
    data_path: list[str] | None = None,
    tokenizer_model: str | None = None,
    dpu_warmup_steps: int | None = None,
    train_tokens: float = TRAIN_TOKENS,
) -> str:
    """The torchrun command that trains ``cfg`` as planned, for ``train_tokens`` tokens:
    the launcher's words, then one line per group of pretrain_gpt.py's flags."""
    iters = math.ceil(train_tokens / st.tokens_per_step)
    flags = [
        ["--tensor-model-parallel-size", str(run.tp)] if run.tp > 1 else [],
        _shape_flags(cfg),
        model_flags(cfg, OPTION_FIELDS),  # RMSNorm, SwiGLU, rope, GQA, ...
        _batch_flags(cfg, run, st),
        _optimizer_flags(cfg, run, precision, dpu_warmup_steps),
        [
            "--data-path",
            *(data_path or ["$DATA_PATH"]),
            "--tokenizer-model",
            tokenizer_model or "$TOKENIZER_MODEL",
        ],
        _schedule_flags(iters),
        _SAVE_FLAGS,
    ]
    return " \\\n    ".join([_words(_torchrun(plan)), *(_words(f) for f in flags if f)])


def _words(ws) -> str:
    """Shell words; $VARS stay expandable: quoted with "..." instead of '...'."""
    return " ".join(f'"{w}"' if w.startswith("$") else shlex.quote(w) for w in ws)


def _torchrun(plan: JobPlan) -> list[str]:
    """The launcher and its rendezvous: standalone on one node, node 0's address on more."""
    nodes, per_node = len(plan.node_ranks), max(plan.node_ranks)
    if nodes > 1:
        where = ["--nnodes", str(nodes), "--node-rank", "$NODE_RANK"]
        where += ["--master-addr", "$MASTER_ADDR", "--master-port", "29500"]
    else:
        where = ["--standalone"]
    return ["torchrun", *where, "--nproc-per-node", str(per_node), "pretrain_gpt.py"]


def _shape_flags(cfg: GPTConfig) -> list[str]:
    """Depth, width and heads; the FFN width only when it is not the default 4h."""
    shape = ["--num-layers", str(cfg.num_layers), "--hidden-size", str(cfg.hidden_size)]
    shape += ["--num-attention-heads", str(cfg.num_attention_heads)]
    if cfg.ffn_hidden_size != 4 * cfg.hidden_size:
        shape += ["--ffn-hidden-size", str(cfg.ffn_hidden_size)]
    return shape


def _batch_flags(cfg: GPTConfig, run: Run, st: StepTime) -> list[str]:
    """Sequence length and the batch the throughput model priced."""
    seq = ["--seq-length", str(cfg.seq_length)]
    seq += ["--max-position-embeddings", str(cfg.max_position_embeddings)]
    batch = ["--micro-batch-size", str(run.micro_batch)]
    batch += ["--global-batch-size", str(st.tokens_per_step // cfg.seq_length)]
    return seq + batch


_MODE_FLAGS = {
    "offload": ("--cpu-offload",),
    "zero2": (),
    "pytorch": ("--optimizer", "torch-adamw"),
}


def _optimizer_flags(
    cfg: GPTConfig, run: Run, precision: str, dpu_warmup_steps: int | None
) -> list[str]:
    """Precision, the planned mode and its options, and the memory savers planned with."""
    opt = [f"--{precision}"] if precision != "fp32" else []
    opt += _MODE_FLAGS.get(run.mode, ())
    f = run.options.offload_fraction
    if run.mode == "offload" and f < 1:
        opt += ["--optimizer-offload-fraction", str(f)]
    if run.mode == "offload" and dpu_warmup_steps is not None:
        opt += ["--dpu-warmup-steps", str(dpu_warmup_steps)]
    opt += _host_state_flags(run)
    if cfg.recompute_activations:
        opt += ["--recompute-activations"]
    if cfg.sequence_parallel and run.tp > 1:  # planned with sequence-sharded activations
        opt += ["--sequence-parallel"]
    return opt


def _host_state_flags(run: Run) -> list[str]:
    """The optimizer options planned with, as flags: the moment dtypes, remainders, the
    overlap, device accumulation and fp32 reduction (a comparison mode's run holds only
    what that mode keeps: ``memory.device_resident``)."""
    o = run.options
    names = {dt: name for name, dt in MOMENT_DTYPES.items() if name != "fp32"}
    out = []
    for flag, dt in (
        ("--exp-avg-dtype", o.exp_avg_dtype),
        ("--exp-avg-sq-dtype", o.exp_avg_sq_dtype),
    ):
        out += [flag, names[dt]] if dt in names else []
    switches = (
        ("--store-param-remainders", o.store_param_remainders),
        ("--overlap-cpu-optimizer", o.overlap_cpu_optimizer),
        ("--accumulate-grads-on-device", o.accumulate_on_device),
        ("--accumulate-allreduce-grads-in-fp32", o.reduce_dtype == torch.float32),
    )
    return out + [flag for flag, on in switches if on]


def _schedule_flags(iters: int) -> list[str]:
    """``iters`` iterations at the launch scripts' learning-rate schedule and AdamW."""
    warmup = max(1, min(2000, iters // 10))
    return [
        "--train-iters",
        str(iters),
        "--lr",
        "1e-4",
        "--min-lr",
        "1e-5",
        "--lr-warmup-iters",
        str(warmup),
        "--weight-decay",
        "0.1",
        "--adam-beta2",
        "0.95",
    ]


# Checkpoints every 500 iterations into ./checkpoints, resumed from there when relaunched.
_SAVE_FLAGS = (
    "--save",
    "checkpoints",
    "--load",
    "checkpoints",
    "--save-interval",
    "500",
    "--log-json",
    "checkpoints/log.jsonl",
)
