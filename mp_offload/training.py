"""The pretraining loop; ``pretrain_gpt.py`` is a thin entry point over ``pretrain``.

Order of one run: parse + validate + ``resolve`` the flags (final from then on; a bad flag
was already refused before torch was imported, by pretrain_gpt.py), then
check the input files and load the tokenizer (every rank, before any collective) ->
process groups -> data (which fixes the vocabulary: the run's final ``Args`` are the
flags ``with_data``) -> model (fp32 on the CPU, the same full weights for every TP
size) -> optimizer (which places the model on the device in the compute dtype) ->
checkpoint loaded, then ``<--save>/config.yaml`` written -> iterations -> final
evaluation.

Whatever stops a run ends as one line, printed once for the job (``distributed.fail``):
exit code 2 for bad flags or input, 1 for run-time failures (divergence, a lost or
stalled rank, a full disk). Workers started by a launcher end with it (``lifeline``).

``train_step`` is one optimizer step over a global batch; the loop (``train``) and the
end-to-end benchmark both call it, so what is measured is what trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from . import parallel_state as ps
from .checkpoint import (
    CheckpointError,
    disk_full_guard,
    load_checkpoint,
    prepare_save,
    save_checkpoint,
)
from .checkpoint.on_disk import is_complete
from .config import Args, ConfigError, checked, config_warnings
from .config.file import write_run_config
from .data.build import RunData, batch_iterator, build_datasets
from .divergence import Skips, TrainingError, check_loss
from .generation import TextSampler
from .lr_scheduler import LRScheduler
from .memory_check import check_memory
from .model.gpt import GPTModel, flops_per_token, num_parameters
from .optimizer import Optimizer, StepResult, build_optimizer
from .runtime import faults, lifeline
from .runtime.distributed import (
    DeviceError,
    RendezvousError,
    StartupError,
    agreed,
    apply_cpu_threads,
    claim_report,
    comm_failure,
    current_phase,
    fail,
    first_error,
    host_threads,
    init_distributed,
    numa_report,
    set_phase,
)
from .runtime.logger import Logger, log, run_summary
from .runtime.phase_timer import PhaseTimer
from .runtime.stopping import StopFlag, restore_handlers, stop_outside_the_loop
from .tensor_parallel import model_parallel_seed


def dp_mean(value: torch.Tensor, dp: ps.ParallelGroup) -> float:
    """The mean of a per-rank scalar over the DP group."""
    v = value.detach().float().reshape(1).clone()
    if dp.size > 1:
        dist.all_reduce(v, group=dp.torch_group())
    return float(v.item()) / dp.size


def autocast(optimizer: Optimizer, device: torch.device):
    dtype = optimizer.autocast_dtype
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


@dataclass
class StepOutput:
    loss: float  # mean over the global batch (all DP ranks)
    result: StepResult
    optimizer_ms: float = 0.0  # wall time of optimizer.step (the host phase with offload)
    # the device's tail of backward, which the step's norm would wait for: kept apart so
    # optimizer_ms is the optimizer's own time
    device_tail_ms: float = 0.0
    phases: dict = dataclasses.field(default_factory=dict)  # PhaseTimer.ms(): device time


def _wait_for_device(device: torch.device) -> None:
    """Until the device has run what was queued (a blocking event: the thread sleeps)."""
    if device.type == "cuda":
        done = torch.cuda.Event(blocking=True)
        done.record()
        done.synchronize()


def train_step(
    model,
    optimizer: Optimizer,
    batches,
    num_micro: int,
    lr: float,
    dp: ps.ParallelGroup,
    device: torch.device,
) -> StepOutput:
    """One optimizer step: ``num_micro`` forward/backward passes, then ``optimizer.step``.

    ``batches`` yields [micro, seq+1] token tensors; the loss of each micro-batch is
    divided by ``num_micro`` so the step sees the mean gradient of the global batch.
    """
    timer = PhaseTimer(device)
    timer.mark("zero_grad")
    optimizer.zero_grad(lr=lr)  # before backward: the overlapped CPU Adam needs it
    loss_sum = torch.zeros((), device=device)
    timer.mark("forward_backward")
    for _ in range(num_micro):
        try:
            tokens = next(batches)
        except StopIteration:
            raise TrainingError("training data ran out") from None
        with autocast(optimizer, device):
            loss = model(tokens[:, :-1], tokens[:, 1:]).mean() / num_micro
        optimizer.backward(loss)
        loss_sum += loss.detach()
    timer.mark("optimizer")
    t0 = time.perf_counter()
    _wait_for_device(device)
    t1 = time.perf_counter()
    result = optimizer.step(lr)
    optimizer_ms = (time.perf_counter() - t1) * 1e3
    timer.mark(None)
    return StepOutput(
        loss=dp_mean(loss_sum, dp),
        result=result,
        optimizer_ms=optimizer_ms,
        device_tail_ms=(t1 - t0) * 1e3,
        phases=timer.ms(),
    )


def evaluate(model, optimizer: Optimizer, batches, device, num_iters: int) -> float | None:
    if batches is None:
        return None
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad(), autocast(optimizer, device):
        for _ in range(num_iters):
            try:
                tokens = next(batches)
            except StopIteration:
                break
            loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
            total += dp_mean(loss, ps.get_data_parallel_group())
            n += 1
    model.train()
    return total / n if n else None


def _sample(sampler: TextSampler | None, model, optimizer, device, iteration, logger) -> None:
    if sampler:
        logger.sample(iteration, sampler(model, autocast(optimizer, device)))


def _save(args: Args, iteration: int, consumed: int, model, optimizer, skips=None) -> None:
    set_phase(f"the checkpoint save at iteration {iteration}")
    t0 = time.perf_counter()
    keep, protect = args.ckpt.keep_checkpoints, skips.protect() if skips else None
    with disk_full_guard(args.ckpt.save, iteration):
        path = save_checkpoint(
            args.ckpt.save, iteration, consumed, model, optimizer, args, keep=keep, protect=protect
        )
    if skips:
        skips.saved(iteration)
    log.info(f"saved checkpoint {path} in {time.perf_counter() - t0:.1f}s")


def _record(
    args: Args,
    iteration: int,
    consumed: int,
    lr: float,
    out: StepOutput,
    optimizer: Optimizer,
    elapsed: float,
    flops_tok: int,
) -> dict:
    """The log record of one iteration (Megatron's fields plus throughput and traffic)."""
    t = args.train
    tokens_per_sec = t.global_batch_size * args.model.seq_length / elapsed
    rec = dict(
        iteration=iteration,
        consumed_samples=consumed,
        loss=out.loss,
        lr=lr,
        grad_norm=out.result.grad_norm,
        loss_scale=out.result.loss_scale,
        skipped_iterations=optimizer.skipped_steps,
        tokens_per_sec=tokens_per_sec,
        elapsed_ms=elapsed * 1e3,
        optimizer_ms=out.optimizer_ms,
        device_tail_ms=out.device_tail_ms,
        **out.phases,
        tflops_per_device=flops_tok * tokens_per_sec / dist.get_world_size() / 1e12,
    )
    rec.update(optimizer.stats())
    return rec


def _evaluation(args: Args, model, optimizer, valid_iter, device, logger, iteration, sampler):
    """Validation (and the sample) at ``iteration``."""
    set_phase(f"the evaluation at iteration {iteration}")
    loss = evaluate(model, optimizer, valid_iter, device, args.train.eval_iters)
    logger.evaluation(iteration, "valid", loss)
    _sample(sampler, model, optimizer, device, iteration, logger)


def train(
    args: Args,
    model,
    optimizer: Optimizer,
    train_iter,
    valid_iter,
    device,
    logger: Logger,
    start_iteration: int = 0,
    consumed_samples: int = 0,
    sampler: TextSampler | None = None,
    stop: StopFlag | None = None,
) -> dict:
    """Iterate from ``start_iteration`` to --train-iters (or --exit-interval, or a signal
    that ``stop`` caught), evaluating (and sampling) and saving on their intervals;
    returns the last iteration's record."""
    t = args.train
    dp = ps.get_data_parallel_group()
    sched = LRScheduler.from_args(args)
    iteration, last, saved_at = start_iteration, {}, start_iteration
    save_every = args.ckpt.save_interval if args.ckpt.save else None
    end = t.train_iters if t.exit_interval is None else min(t.train_iters, t.exit_interval)
    evaluation = functools.partial(_evaluation, args, model, optimizer, valid_iter, device, logger)
    if t.eval_interval and iteration == 0 and valid_iter is not None:
        evaluation(0, sampler)  # a baseline: the log shows how far validation loss has come
    model.train()
    logger.start_loop(iteration, t.train_iters)
    flops_tok = flops_per_token(
        args.model, args.model.recompute_activations, args.parallel.tensor_model_parallel_size
    )
    skips = Skips(t.max_consecutive_skipped_steps, start_iteration)
    while iteration < end:
        set_phase(f"iteration {iteration + 1}")
        faults.before_iteration(iteration + 1)
        t0 = time.perf_counter()
        lr = sched.get_lr(consumed_samples)
        try:
            out = train_step(model, optimizer, train_iter, t.num_micro_batches, lr, dp, device)
        except TrainingError as e:
            raise TrainingError(f"{e} at iteration {iteration}") from None
        iteration += 1
        consumed_samples += t.global_batch_size
        check_loss(out.loss, iteration)
        skips.step(out, iteration)
        elapsed = time.perf_counter() - t0
        last = _record(args, iteration, consumed_samples, lr, out, optimizer, elapsed, flops_tok)
        logger.iteration(last, print_line=iteration % args.log.log_interval == 0)
        if t.eval_interval and iteration % t.eval_interval == 0 and iteration < t.train_iters:
            evaluation(iteration, sampler)
        faults.after_iteration(iteration)
        if save_every and iteration % save_every == 0:
            _save(args, iteration, consumed_samples, model, optimizer, skips)
            saved_at = iteration
        if stop is not None and stop.agreed():
            log.info(f"stop requested: exiting after iteration {iteration}")
            break
    optimizer.flush()
    skips.check_run(iteration)
    if args.ckpt.save and saved_at != iteration:
        _save(args, iteration, consumed_samples, model, optimizer, skips)
    return dict(last, iteration=iteration, consumed_samples=consumed_samples)


def _maybe_load(args: Args, model, optimizer) -> tuple[int, int]:
    c = args.ckpt
    if not c.load:
        return 0, 0
    weights_only = c.finetune or c.no_load_optim
    res = load_checkpoint(
        c.load,
        model,
        optimizer,
        args,
        load_optim=not weights_only,
        load_rng=not (c.finetune or c.no_load_rng),
        log=log.info,
    )
    if res is None:
        log.info(f"no checkpoint in {c.load}: starting from scratch")
        return 0, 0
    log.info(
        f"loaded checkpoint from {c.load} at iteration {res[0]}"
        f"{' (weights only)' if weights_only else ''}"
    )
    return (0, 0) if c.finetune else res


def _check_resume(args: Args, start: int) -> None:
    """A checkpoint past the new --train-iters has consumed more samples than the run
    has (every rank loaded the same iteration, so all of them stop here)."""
    if start > args.train.train_iters:
        raise ConfigError(
            f"--train-iters {args.train.train_iters} is below iteration {start} of the "
            f"checkpoint loaded from --load {args.ckpt.load}: give --train-iters above "
            f"{start} to train on (or --finetune to start a new run from its weights)"
        )


def _checked_args(argv) -> tuple[Args, int]:
    """The final flags (``config.checked``), checked on every rank before any collective
    (fail() on error), and the world size they are for."""
    try:
        return checked(argv)
    except ConfigError as e:
        fail(str(e))


def offload_note(o) -> str:
    """Where the optimizer state lives, for the start-up line: F=0 offloads nothing."""
    fraction = 1.0 if o.optimizer_offload_fraction is None else o.optimizer_offload_fraction
    if not o.cpu_offload:
        return ""
    if fraction == 0:
        return " (offload fraction 0: all optimizer state on the device, ZeRO-2)"
    if fraction < 1:
        return f" (cpu offload of {fraction:g} of the optimizer state)"
    return " (cpu offload)"


def build_model_and_optimizer(args: Args, device: torch.device):
    """The GPT (the same full weights for every TP size) and its optimizer."""
    torch.manual_seed(args.train.seed)
    model = GPTModel(args.model)
    model_parallel_seed(args.train.seed, ps.get_tensor_model_parallel_rank(), device.type)
    optimizer = build_optimizer(model, args, device)
    tp = args.parallel.tensor_model_parallel_size
    llama = args.model.normalization == "RMSNorm" and args.model.swiglu
    log.info(
        f"{'Llama' if llama else 'GPT'}: {num_parameters(args.model, tp) / 1e6:.2f}M parameters, "
        f"TP={tp} DP={ps.get_data_parallel_world_size()} device={device.type} "
        f"optimizer={args.optim.optimizer}{offload_note(args.optim)}"
    )
    report = optimizer.memory_report()
    if report:
        log.info(report)
    return model, optimizer


def with_data(args: Args, data: RunData) -> Args:
    """The run's final ``Args``: the flags with what its data fixed (the vocabulary of the
    tokenizer, the tokenizer model the default corpus brought, recorded with each
    checkpoint so that generation and export find it)."""
    model = dataclasses.replace(args.model, vocab_size=data.vocab_size)
    if data.tokenizer_model == args.data.tokenizer_model:
        return dataclasses.replace(args, model=model)
    d = dataclasses.replace(args.data, tokenizer_model=data.tokenizer_model)
    return dataclasses.replace(args, model=model, data=d)


def _text_sampler(args: Args, data: RunData) -> TextSampler | None:
    if args.log.sample_prompt is None:
        return None
    if data.tokenizer is None:
        raise TrainingError("--sample-prompt: a vocabulary of one id (--vocab-size 1) has no text")
    try:
        return TextSampler(
            data.tokenizer, data.stops_at_eod, args.log.sample_prompt, args.log.sample_tokens
        )
    except ValueError as e:
        raise TrainingError(str(e)) from None


def _record_config(flags: Args) -> None:
    """``<--save>/config.yaml``: the flags as resolved (``--config`` reads them back to the
    same run; the values the data fixed follow from them again), written once the run has
    started from its directory: a resume the checkpoints refuse leaves the file as it was."""
    error = first_error(write_run_config(flags, log.info) if dist.get_rank() == 0 else None)
    if error:
        fail(error, code=1)


def _run(flags: Args, device, logger: Logger, tokenizer=None) -> dict:
    data = build_datasets(flags, tokenizer)
    args = with_data(flags, data)
    sampler = _text_sampler(args, data)
    set_phase("building the model and optimizer")
    model, optimizer = build_model_and_optimizer(args, device)
    set_phase("loading the checkpoint")
    start, consumed = _maybe_load(args, model, optimizer)
    _check_resume(args, start)
    _record_config(flags)
    # Validation batches continue where the uninterrupted run would be (baseline + evals).
    t = args.train
    per_eval = t.eval_iters * t.micro_batch_size * ps.get_data_parallel_world_size()
    valid_consumed = (start // t.eval_interval + 1) * per_eval if start and t.eval_interval else 0
    train_iter = batch_iterator(data.train, args, consumed, device)
    valid_iter = batch_iterator(data.valid, args, valid_consumed, device)
    with StopFlag(args.ckpt.save) as stop:
        summary = train(
            args,
            model,
            optimizer,
            train_iter,
            valid_iter,
            device,
            logger,
            start,
            consumed,
            sampler,
            stop,
        )
    if summary.get("iteration", 0) >= t.train_iters:
        set_phase("the final evaluation")
        for name, ds in (("valid", data.valid), ("test", data.test)):
            batches = batch_iterator(ds, args, 0, device)
            loss = evaluate(model, optimizer, batches, device, t.eval_iters)
            logger.evaluation(summary["iteration"], name, loss)
    _sample(sampler, model, optimizer, device, summary["iteration"], logger)
    written = bool(args.ckpt.save) and is_complete(args.ckpt.save, summary["iteration"])
    log.info(run_summary(args, logger, summary, start, consumed, written))
    return summary


def flat_config(args: Args) -> dict:
    """Every field of every group in one dict (the W&B run config)."""
    return {k: v for group in vars(args).values() for k, v in dataclasses.asdict(group).items()}


def _start(args: Args):
    """Every check that needs no other rank, then the process groups: (device, tokenizer)."""
    from .preflight import check_inputs

    stop = lifeline.exit_with_parent()
    if stop:
        fail(stop, code=1, everywhere=False)
    tokenizer = None
    try:
        tokenizer = check_inputs(args)
    except ConfigError as e:
        fail(str(e))
    p = args.parallel
    try:
        device = init_distributed(p.device, p.distributed_timeout_minutes)
    except DeviceError as e:
        fail(str(e), everywhere=False)  # this rank's own (its LOCAL_RANK has no GPU)
    except RendezvousError as e:
        fail(str(e), code=1, everywhere=False)
    check_memory(args, device, tokenizer)  # before anything is allocated
    ps.initialize_model_parallel(
        p.tensor_model_parallel_size, timedelta(minutes=p.distributed_timeout_minutes)
    )
    gpu = device.type == "cuda"
    threads, busy = host_threads(p.cpu_threads_per_rank, gpu=gpu)
    if busy:
        log.info(busy)
    log.info(apply_cpu_threads(threads))
    if gpu:  # each rank's NUMA node and cores (numa.py); CPU runs are not bound
        log.info(numa_report(device))
    for line in config_warnings(args):
        log.info(line)
    return device, tokenizer


def _stop(e: Exception) -> None:
    """End the run after ``e`` with one line for the job (a bug keeps its traceback)."""
    if isinstance(e, (ConfigError, StartupError)):
        fail(str(e))  # every rank holds it (agreed)
    if isinstance(e, TrainingError):
        fail(str(e), code=1)  # every rank reached it (the loss and the skips are global)
    if isinstance(e, CheckpointError):
        fail(str(e), code=1, everywhere=False)
    reason = comm_failure(e)
    if reason:
        fail(reason, code=1, everywhere=False)  # quiet when the rank that stopped said why
    if isinstance(e, OSError):  # a full disk, a file gone: this rank's own
        fail(f"{e} (during {current_phase()})", code=1, everywhere=False)
    claim_report()  # a bug: its traceback is the report; the other ranks stay quiet


def pretrain(argv=None) -> dict:
    """The whole run for ``pretrain_gpt.py``'s flags; returns the last iteration's record."""
    args, world = _checked_args(argv)
    if args.train.dry_run:
        from .planner.dry_run import dry_run  # deferred: only the planner needs it

        try:
            dry_run(args, world)
        except ConfigError as e:  # a PLAN_* variable out of range
            fail(str(e))
        return {}
    handlers = stop_outside_the_loop(args.ckpt.save)  # the loop's StopFlag takes over
    device, tokenizer = _start(args)
    logger, lock = None, None
    try:
        logger = agreed(
            lambda: Logger(args.log, is_main=dist.get_rank() == 0, run_config=flat_config(args))
        )
        try:  # before anything is built: a bad --save/--load pair must cost nothing
            lock = prepare_save(args.ckpt, log=log.info)
        except CheckpointError as e:
            fail(str(e))  # status 2, like a bad flag: nothing ran (every rank holds it)
        summary = _run(args, device, logger, tokenizer)
        logger.close()  # the last records reach the disk here: a full one is an error
        return summary
    except Exception as e:
        _stop(e)
        raise
    finally:
        if lock is not None:
            lock.release()
        if logger is not None:
            with contextlib.suppress(OSError):  # already failing: the reason is out
                logger.close()
        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        restore_handlers(handlers)
