#!/usr/bin/env python
"""Fine-tune any local Hugging Face causal LM with OffloadAdamW (ZeRO-Offload).

    torchrun --nproc-per-node 2 tools/finetune_hf.py --hf-model DIR --data train.jsonl \\
        --train-iters 200 --micro-batch-size 4 --global-batch-size 32 --seq-length 1024 \\
        --lr 2e-5 --lr-warmup-iters 20 --bf16 --save ckpt --save-interval 50 --hf-out out

Any ``AutoModelForCausalLM`` directory works (``--from-config DIR``: its config, randomly
initialized). The ranks are data parallel: each holds the whole model, OffloadAdamW
averages the gradients and keeps its share of the fp32 master and moments on the CPU.
Data: JSONL (mp_offload/hf_finetune/jsonl_data.py), the loss on the completions only,
averaged over every target token of the global batch. Ctrl-C (SIGINT/SIGTERM) finishes
the step, saves and exits; ``--load`` resumes exactly (weights and moments from the
optimizer's state, the data position and every rank's random state). ``--hf-out``
writes the trained model with ``save_pretrained`` (and the tokenizer) at the end.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time

PROG = "finetune_hf.py"


def _fail(line: str, code: int = 2):
    """Every rank exits with ``code``; rank 0 says why in one line."""
    if int(os.environ.get("RANK", "0")) == 0:
        sys.stdout.flush()
        sys.stderr.write(f"{PROG}: error: {line}\n")
        sys.stderr.flush()
    sys.exit(code)


def _say(line: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


class _StopFlag:
    """SIGINT/SIGTERM: finish the step, then every rank agrees to stop (checked after
    each step, an all-reduce of one number)."""

    def __init__(self):
        self.requested = False
        self.previous = {
            s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)
        }

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handler(self, signum, frame):
        self.requested = True

    def agreed(self) -> bool:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return self.requested
        flag = torch.tensor([float(self.requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0


def _load_inputs(argv, world: int):
    """The flags, tokenizer, examples and model: everything that can be bad input, checked
    before any process group starts (every rank finds the same problem)."""
    from mp_offload.hf_finetune import BadInput, finetune_flags, jsonl_data

    try:
        args = finetune_flags.parse(argv, world)
    except BadInput as e:
        _fail(str(e))
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one progress line per step is ours
    flag = "--hf-model" if args.hf_model else "--from-config"
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    except (OSError, ValueError) as e:
        _fail(f"--tokenizer {args.tokenizer}: cannot load a tokenizer ({_first(e)})")
    try:
        kind, examples, dropped = jsonl_data.tokenize(args.data, tokenizer, args.seq_length)
    except BadInput as e:
        _fail(str(e))
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"--data {args.data}: {_first(e)}")
    torch.manual_seed(args.seed)
    try:
        if args.hf_model:
            model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
        else:
            config = AutoConfig.from_pretrained(args.model_dir)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        _fail(f"{flag} {args.model_dir}: cannot load the model ({_first(e)})")
    model.config.use_cache = False
    return args, tokenizer, (kind, examples, dropped), model


def _first(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _start_group(world: int):
    """This rank's device and, under torchrun, the process group (gloo on the CPU)."""
    import torch
    import torch.distributed as dist

    from mp_offload.runtime.distributed import DeviceError, pick_device

    try:
        device = pick_device()
    except DeviceError as e:
        _fail(str(e))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def _optimizer(args, model, device):
    import mp_offload
    from mp_offload.hf_finetune.finetune_flags import compute_dtype, optimizer_modes

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        dict(params=[(n, p) for n, p in named if p.ndim >= 2], weight_decay=args.weight_decay),
        dict(params=[(n, p) for n, p in named if p.ndim < 2], weight_decay=0.0),
    ]
    try:
        return mp_offload.OffloadAdamW(
            [g for g in groups if g["params"]],
            lr=args.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
            clip_grad=args.clip_grad or None,
            dtype=compute_dtype(args),
            device=device,
            model=model,  # its buffers (rotary tables, masks) go to the device too
            **optimizer_modes(args),
        )
    except ValueError as e:
        _fail(_first(e))


def _step(model, opt, batches, examples, consumed, pad_id, device, world):
    """One optimizer step over the global batch at ``consumed``: (the mean loss over its
    target tokens, its tokens). Each micro-batch's summed cross-entropy is divided by the
    global batch's target count (known on every rank from the data alone), times the
    world that the optimizer's gradient average divides by again."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from mp_offload.hf_finetune.jsonl_data import IGNORE, collate

    everyone = [examples[i] for i in batches.global_batch_at(consumed)]
    targets = sum(e.targets for e in everyone)
    local = torch.zeros(())
    for micro in batches.micro_batches_at(consumed):
        batch = {k: v.to(device) for k, v in collate([examples[i] for i in micro], pad_id).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        ce = F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(),
            batch["labels"][:, 1:].flatten(),
            ignore_index=IGNORE,
            reduction="sum",
        )
        opt.backward(ce * (world / targets))
        local += ce.detach().cpu()
    opt.step()
    opt.zero_grad()
    if dist.is_initialized():
        dist.all_reduce(local)
    return local.item() / targets, sum(len(e.input_ids) for e in everyone)


def _clock(seconds: float) -> str:
    s = int(seconds)
    return (
        f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


def _memory(opt, device) -> str:
    import torch

    host_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB -> MiB
    if device.type == "cuda":
        dev = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        dev = sum(opt.memory_report()["device"].values()) / 2**20
    return f"device {dev:.1f} MiB | host peak RSS {host_rss:.0f} MiB"


def _progress(args, it, loss, lr, result, tokens_s, started, done, opt, device) -> dict:
    elapsed = time.perf_counter() - started
    eta = elapsed / max(done, 1) * (args.train_iters - it)
    rec = dict(iteration=it, loss=loss, lr=lr, grad_norm=result.grad_norm,
               skipped=result.skipped, tokens_per_sec=tokens_s)  # fmt: skip
    if it % args.log_interval == 0 or it == args.train_iters:
        _say(
            f"iteration {it}/{args.train_iters} | loss {loss:.4f} | lr {lr:.3e} | "
            f"grad norm {result.grad_norm:.3f} | {tokens_s:,.0f} tokens/s | elapsed "
            f"{_clock(elapsed)} | ETA {_clock(eta)} | {_memory(opt, device)}"
            + (" | skipped (fp16 overflow)" if result.skipped else "")
        )
    return rec


def _settings(args) -> dict:
    keep = ("model_dir", "data", "seq_length", "micro_batch_size", "global_batch_size", "lr",
            "min_lr", "seed", "bf16", "fp16")  # fmt: skip
    return {k: getattr(args, k) for k in keep}


def train(args, model, opt, examples, tokenizer, device, world, rank, start=(0, 0)):
    """Iterate to --train-iters (or a stop signal); returns (the iteration reached, the
    iteration last saved or None)."""
    from mp_offload.hf_finetune import run_state
    from mp_offload.hf_finetune.jsonl_data import GlobalBatches
    from mp_offload.lr_scheduler import LRScheduler

    gbs = args.global_batch_size
    batches = GlobalBatches(len(examples), gbs, args.micro_batch_size, world, rank, args.seed)
    decay = (args.lr_decay_iters or args.train_iters) * gbs
    sched = LRScheduler(
        args.lr, args.min_lr, args.lr_warmup_iters * gbs, decay, args.lr_decay_style
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    log = open(args.log_json, "a") if args.log_json and rank == 0 else None  # noqa: SIM115
    stop, (it, consumed), saved = _StopFlag(), start, None
    started, first = time.perf_counter(), start[0]
    save = lambda: _say(f"saved {run_state.save(opt, args.save, it, consumed, _settings(args))}")
    model.train()
    try:
        while it < args.train_iters:
            t0 = time.perf_counter()
            lr = sched.get_lr(consumed)
            for g in opt.param_groups:
                g["lr"] = lr
            loss, tokens = _step(model, opt, batches, examples, consumed, pad_id, device, world)
            it, consumed = it + 1, consumed + gbs
            tokens_s = tokens / (time.perf_counter() - t0)
            done = it - first
            rec = _progress(args, it, loss, lr, opt.last_step, tokens_s, started, done, opt, device)
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            stopping = stop.agreed()
            if args.save and (stopping or (args.save_interval and it % args.save_interval == 0)):
                save()
                saved = it
            if stopping:
                _say(
                    f"stopped at iteration {it} by a signal" + ("" if args.save else " (no --save)")
                )
                break
    finally:
        stop.restore()
        if log:
            log.close()
    if args.save and saved != it and it > first:
        save()
        saved = it
    return it, saved


def main(argv=None):
    """The whole run; returns the trained model (the tests compare it with the export)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args, tokenizer, (kind, examples, dropped), model = _load_inputs(argv, world)
    import torch.distributed as dist

    from mp_offload.hf_finetune import run_state
    from mp_offload.hf_finetune.finetune_flags import compute_dtype

    device = _start_group(world)
    rank = dist.get_rank() if dist.is_initialized() else 0
    opt = _optimizer(args, model, device)
    n = sum(p.numel() for p in model.parameters())
    _say(
        f"{type(model).__name__}: {n / 1e6:.2f}M parameters, {world} data-parallel rank(s), "
        f"{len(examples)} {kind} examples ({dropped} dropped: no target within --seq-length), "
        f"{args.accumulation_steps} micro-batch(es) per rank per step"
    )
    start = (0, 0)
    if args.load:
        trainer = run_state.load(opt, args.load_path, args.seed)
        start = (trainer["iteration"], trainer["consumed_samples"])
        _say(f"resumed from {args.load_path} at iteration {start[0]}")
    it, _ = train(args, model, opt, examples, tokenizer, device, world, rank, start)
    if args.hf_out and it >= args.train_iters:
        if run_state.export(model, opt, tokenizer, args.hf_out, compute_dtype(args)):
            _say(f"exported to {args.hf_out} (AutoModelForCausalLM.from_pretrained loads it)")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return model


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
    from mp_offload.runtime.early_exit import finished

    finished()  # at once: the C++ teardown at exit has aborted a finished rank
