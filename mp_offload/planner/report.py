"""What the plan command line prints: the model in a line, the assumptions and
hardware, the offload fraction, the speed, wall time and launch line, the largest model
per mode, the recipes' table (--paper-table), the throughput table, the plan as JSON.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

from ..config import Args, resolve
from ..model.gpt import flops_per_token, num_parameters
from .answer import (
    MODE_LABELS,
    TRAIN_TOKENS,
    compare_max_models,
    format_max_models,
    format_overlap,
    format_speed,
    format_split_gain,
    format_streamed,
    format_wall_time,
    larger_elsewhere,
    launch_command,
    overlap_exposed,
    speed,
)
from .arguments import _machine, parse, run_from_args
from .fraction import pick_offload_fraction
from .host_forms import format_host_form_gains, host_form_gains
from .memory import EXACT, GiB, Hardware, JobPlan, Run, format_job, moment_bytes, plan_job
from .named_models import MACHINE_GPUS, RECIPES, recipe_label
from .throughput import format_scaling, plot_scaling, scaling, ten_b


def _options(m) -> str:
    """The non-GPT-2 parts of a model, for the one-line description."""
    parts = ["RMSNorm"] if m.rms_norm else []
    parts += ["SwiGLU"] if m.swiglu else []
    if m.position_embedding_type == "rope":
        base, percent = m.rotary
        parts.append(f"rope base {base:g}" + (f" x{percent:g}" if percent != 1 else ""))
    parts += [f"GQA {m.num_query_groups} groups"] if m.group_query_attention else []
    parts += ["untied head"] if m.untie_embeddings_and_output_weights else []
    parts += ["no linear bias"] if m.disable_bias_linear else []
    parts += ["sequence parallel"] if m.sequence_parallel else []
    return f" ({', '.join(parts)})" if parts else ""


def describe_model(args: Args, world: int) -> str:
    m, tp = args.model, args.parallel.tensor_model_parallel_size
    rc = m.recompute_activations
    n = num_parameters(m, tp)
    f = flops_per_token(m, rc, tp)
    tokens = args.train.global_batch_size * m.seq_length  # (resolved)
    return (
        f"GPT {m.num_layers} layers x hidden {m.hidden_size}, {m.num_attention_heads} heads,"
        f" ffn {m.ffn_hidden_size}, seq {m.seq_length}, padded vocabulary "
        f"{m.padded_vocab_size(tp)}{_options(m)}\n"
        f"parameters {n:,} ({n / 1e9:.2f}B); training FLOPs per token {f / 1e9:.2f} G "
        f"({'with' if rc else 'without'} recomputation); per step "
        f"{tokens:,} tokens = {f * tokens / 1e15:.2f} PFLOP"
    )


def _fraction_line(run: Run, hw: Hardware, machine=None, batch_per_gpu=16) -> tuple[Run, str]:
    """The run at the largest device share that fits (with the overlap, on ``machine``: the
    one of the least exposed optimizer time), and a line saying so."""
    cost = overlap_exposed(run.cfg, run, machine, batch_per_gpu) if machine else None
    f, plan = pick_offload_fraction(run, hw, cost)
    s = plan.ranks[0].shapes
    kept = s.device_share(f)
    which = "largest device share that fits"
    if cost is not None:
        dev, host = cost(f)
        which = (
            f"device share of the least exposed optimizer time with --overlap-cpu-optimizer "
            f"(device Adam {dev:.3f} s, host after backward {host:.3f} s) of those that fit"
        )
    if f == 1.0:
        if not plan.fits_device:
            why = "it does not fit even so"
        elif 1 in moment_bytes(run.options):
            why = "8-bit moments live on the host only"
        else:
            why = f"the {which}" if cost is not None else "nothing more fits the device"
        return run, f"offload fraction: 1 (all of the optimizer state on the host: {why})"
    zero2 = ", = ZeRO-2 without offload" if f == 0 else ""
    return run.at_fraction(f), (
        f"offload fraction: --optimizer-offload-fraction {f:g}{zero2} (the {which} "
        f"{hw.device_usable_gb:.1f} GiB: the first {kept:,} of each rank's "
        f"{s.slice_numel:,} elements, {kept / s.slice_numel:.1%} of its optimizer state, stay on "
        f"the device; "
        f"device peak {plan.device_peak / GiB:.2f} GiB)"
    )


def overlap_fits(run: Run, hw: Hardware) -> bool:
    """--overlap-cpu-optimizer is allowed with this run and its second copy of the host
    state fits: only then is it advice."""
    if run.options.overlap_cpu_optimizer:
        return True  # planned with it
    try:
        return plan_job(run.with_options(overlap_cpu_optimizer=True), hw).fits
    except ValueError:  # DPU or 8-bit moments: not with the overlap
        return False


def recipe_plan(recipe) -> tuple[JobPlan, Run]:
    """The plan of one named-model recipe, as ``--model NAME FLAGS`` would make it."""
    args, opt = parse(["--model", recipe.model, *recipe.flags, "--world-size", str(recipe.world)])
    args.train.dry_run = True
    args = resolve(args, recipe.world)
    hw = Hardware(
        opt.device_memory_gb,
        opt.host_memory_gb,
        opt.devices_per_node,
        opt.device_reserved_gb,
        opt.host_process_gb,
        device_memory_reserve_gb=opt.device_memory_reserve_gb,
    )
    run = run_from_args(args, recipe.world, cuda=True)
    return plan_job(run, hw), run


def format_recipe_table() -> str:
    lines = [
        "\nthe Llama recipes (scripts/pretrain_llama*.sh), planned per rank (GiB):",
        f"{'model':<12}{'hardware':<32}{'configuration':<46}{'device':>14}{'host/node':>16}  fits",
    ]
    for recipe in RECIPES:
        plan, run = recipe_plan(recipe)
        dev = f"{plan.device_peak / GiB:.1f}/{plan.hw.device_memory_gb:g}"
        host = f"{plan.host_node_peak / GiB:.0f}/{plan.hw.host_usable_gb:g}"
        why = (
            "yes"
            if plan.fits
            else "no ("
            + ", ".join(
                w for w, ok in (("device", plan.fits_device), ("host", plan.fits_host)) if not ok
            )
            + ")"
        )
        label = f"{recipe_label(recipe)}, k={run.options.micro_batches}"
        lines.append(
            f"{recipe.model:<12}{recipe.hardware:<32}{label:<46}{dev:>14}{host:>16}  {why}"
        )
    return "\n".join(lines)


def _print_json(args: Args, run: Run, plan: JobPlan) -> None:
    rp = plan.ranks[0]
    print(
        json.dumps(
            dict(
                mode=run.mode,
                tp=run.tp,
                dp=run.dp,
                offload_fraction=run.options.offload_fraction,
                device=rp.device,
                host=rp.host,
                device_total=plan.device_peak,
                host_node=plan.host_node_peak,
                fits=plan.fits,
                exact=list(EXACT),
                parameters=num_parameters(args.model, run.tp),
            )
        )
    )


def _precision(args: Args) -> str:
    return "bf16" if args.train.bf16 else "fp16" if args.train.fp16 else "fp32"


def _print_assumed(args: Args, opt, run: Run, hw: Hardware) -> None:
    m = args.model
    nodes = -(-run.world // hw.devices_per_node)
    print(
        f"planning {_precision(args)}, {MODE_LABELS.get(run.mode, run.mode)}, recompute "
        f"{'on' if m.recompute_activations else 'off'}, seq {m.seq_length}, micro-batch "
        f"{run.micro_batch}, TP={run.tp} x DP={run.dp}"
        + (
            f"; assumed (the launch scripts' defaults; give the flag to change it): "
            f"{' '.join(opt.assumed)}"
            if opt.assumed
            else ""
        )
    )
    print(
        f"hardware: {run.world} x {hw.device_memory_gb:g} GiB device(s) "
        f"({hw.device_reserve_gb:.1f} GiB kept free, --device-memory-reserve-gb) "
        f"on {nodes} node(s) "
        f"of {hw.devices_per_node}, host {hw.host_memory_gb:g} GiB per node with "
        f"{hw.host_headroom_gb:.1f} GiB kept free (--host-headroom-gb)"
    )


def _print_speed_and_launch(
    args: Args, opt, run: Run, plan, cfg, machine=None, rate_src: str = ""
) -> None:
    if machine is None:
        machine, rate_src = _machine(opt, plan.hw)
    st = speed(cfg, run, machine, opt.batch_per_gpu)
    print(format_speed(st, cfg, machine, rate_src))
    f = run.options.offload_fraction
    if run.mode == "offload" and f < 1:
        full = speed(cfg, run.at_fraction(1.0), machine, opt.batch_per_gpu)
        print(format_split_gain(st, full))
    if run.mode == "offload" and f > 0:  # some state on the host
        print(format_streamed(st, run, machine))
        if overlap_fits(run, plan.hw):
            print(format_overlap(st, run.micro_batch))
    tokens = _tokens_wanted(args, opt, st)
    print(format_wall_time(tokens or TRAIN_TOKENS, st, _priced_for(opt)))
    where = (
        "every node, with its NODE_RANK and node 0's MASTER_ADDR"
        if len(plan.node_ranks) > 1
        else "this node"
    )
    tokens = tokens or TRAIN_TOKENS
    print(
        f"launch ({where}; {math.ceil(tokens / st.tokens_per_step):,} iterations = "
        f"{tokens / 1e9:g}B tokens):"
    )
    print(
        "  "
        + launch_command(
            cfg,
            run,
            plan,
            st,
            _precision(args),
            args.data.data_path,
            args.data.tokenizer_model,
            args.optim.dpu_warmup_steps,
            train_tokens=tokens,
        )
    )


def _tokens_wanted(args: Args, opt, st) -> float | None:
    """Tokens to train: --train-tokens, or --train-samples / --train-iters at the planned
    global batch; None when none is given."""
    t = args.train
    if opt.train_tokens is not None:
        return opt.train_tokens
    if t.train_samples is not None:
        return t.train_samples * args.model.seq_length
    if t.train_iters is not None:
        return t.train_iters * st.tokens_per_step
    return None


def _priced_for(opt) -> str:
    """Which GPU the speed is the speed of."""
    if opt.machine:
        return f"priced for --machine {opt.machine}: {MACHINE_GPUS[opt.machine]}"
    return (
        "priced for the paper's DGX-2 V100s (no --machine given: pass one, e.g. --machine "
        "hgx-h100, or --device-tflops and the link flags)"
    )


def _answer_max_model(args: Args, opt, run: Run, hw: Hardware) -> int:
    _print_assumed(args, opt, run, hw)
    machine, rate_src = _machine(opt, hw)
    # No F given: offload keeps on the device the share of its state that fits there.
    pick = run.mode == "offload" and args.optim.optimizer_offload_fraction is None
    answers = compare_max_models(run, hw, opt.family, machine, opt.batch_per_gpu, pick)
    mine = answers[run.mode].found
    if mine.cfg is not None:
        c = mine.cfg
        print(
            f"max model ({opt.family}), {run.mode}: {mine.params / 1e9:.2f}B = --num-layers "
            f"{c.num_layers} --hidden-size {c.hidden_size} --num-attention-heads "
            f"{c.num_attention_heads} (stopped by: {mine.limit})"
        )
        print(format_job(mine.plan))
    print(
        f"largest GPT per mode (family {opt.family}), same hardware, TP and batch; "
        f"{opt.batch_per_gpu} sequences per GPU per step:"
    )
    print(format_max_models(answers))
    note = larger_elsewhere(answers, run.mode)
    if note:
        print(note)
    if run.mode == "offload":  # the host-state forms, with the table's micro-batches
        k = max(1, opt.batch_per_gpu // run.micro_batch)
        gains = host_form_gains(run.with_options(micro_batches=k), hw, opt.family, pick)
        print(format_host_form_gains(*gains))
    if mine.cfg is None:
        print(f"max model ({opt.family}): nothing fits with {run.mode}")
        return 1
    _print_speed_and_launch(args, opt, mine.plan.run, mine.plan, mine.cfg, machine, rate_src)
    return 0


def _throughput(args: Args, opt) -> None:
    machine, src = _machine(opt, Hardware(devices_per_node=opt.tp_devices_per_node))
    cfg = ten_b() if opt.throughput_model == "10b" else args.model
    cfg = replace(cfg, recompute_activations=True) if opt.throughput_model == "10b" else cfg
    tp = 1 if opt.throughput_model == "10b" else args.parallel.tensor_model_parallel_size
    rows = scaling(
        cfg,
        machine,
        [g for g in opt.gpus if g % tp == 0],
        tp=tp,
        batch_per_gpu=opt.batch_per_gpu,
        micro_batch=args.train.micro_batch_size,
    )
    print(
        f"throughput model: {num_parameters(cfg, tp) / 1e9:.2f}B ({cfg.num_layers}x"
        f"{cfg.hidden_size}, seq {cfg.seq_length}), TP={tp}, {opt.batch_per_gpu} sequences "
        f"per GPU per step in micro-batches of {args.train.micro_batch_size}; device "
        f"{machine.device_tflops:g} TFLOPS sustained, DP link {machine.intra_node_gbs:g} GB/s "
        f"in a node / {machine.inter_node_gbs:g} GB/s per GPU across, PCIe "
        f"{machine.pcie_gbs:g} GB/s, host {machine.host_mem_gbs:g} GB/s and "
        f"{machine.cpu_cores_per_node} cores per {machine.devices_per_node}-GPU node, CPU Adam "
        f"{machine.adam_rate_per_core / 1e6:.0f} M elements/s per core ({src}); times in "
        "seconds per step"
    )
    print(format_scaling(rows))
    if opt.plot:
        ok = plot_scaling(
            rows,
            opt.plot,
            f"{num_parameters(cfg, tp) / 1e9:.1f}B GPT, "
            f"ZeRO-Offload DP, predicted vs the paper's claim",
        )
        print(f"wrote {opt.plot}" if ok else "matplotlib is not installed: no plot written")
