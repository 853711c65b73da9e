"""The pretraining loop; ``pretrain_gpt.py`` is a thin entry point over ``pretrain``.

Order of one run: parse + validate flags, then check the input files and load the
tokenizer (every rank, before any collective) -> process groups -> data (which fixes
the vocabulary) -> model (fp32 on the CPU, the same full weights for every TP size) ->
optimizer (which places the model on the device in the compute dtype) -> iterations ->
final evaluation.

Whatever stops a run ends as one line, printed once for the job (``distributed.fail``):
exit code 2 for bad flags or input, 1 for run-time failures (divergence, a lost or
stalled rank, a full disk). Workers started by a launcher end with it (``lifeline``).

``train_step`` is one optimizer step over a global batch; the loop (``train``) and the
end-to-end benchmark both call it, so what is measured is what trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from . import faults, lifeline
from . import parallel_state as ps
from .checkpoint import (
    CheckpointError,
    disk_full_guard,
    load_checkpoint,
    prepare_save,
    save_checkpoint,
)
from .checkpoint.format import MANIFEST, iter_dir
from .config import Args, ConfigError, config_warnings, given_flags, parse_args, resolve
from .config_file import dump_config
from .data.build import batch_iterator, build_datasets
from .distributed import (
    DeviceError,
    RendezvousError,
    StartupError,
    agreed,
    apply_cpu_threads,
    claim_report,
    comm_failure,
    current_phase,
    env_int,
    fail,
    first_error,
    init_distributed,
    set_phase,
    threads_per_rank,
)
from .logger import Logger, hms, log
from .lr_scheduler import LRScheduler
from .model.gpt import GPTModel, flops_per_token, num_parameters
from .optimizer import Optimizer, StepResult, build_optimizer
from .tensor_parallel import model_parallel_seed


class TrainingError(RuntimeError):
    """Stops the run with a message (NaN loss, data exhausted...)."""


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
    optimizer.zero_grad()
    loss_sum = torch.zeros((), device=device)
    for _ in range(num_micro):
        try:
            tokens = next(batches)
        except StopIteration:
            raise TrainingError("training data ran out") from None
        with autocast(optimizer, device):
            loss = model(tokens[:, :-1], tokens[:, 1:]).mean() / num_micro
        optimizer.backward(loss)
        loss_sum += loss.detach()
    t0 = time.perf_counter()
    result = optimizer.step(lr)
    optimizer_ms = (time.perf_counter() - t0) * 1e3
    return StepOutput(loss=dp_mean(loss_sum, dp), result=result, optimizer_ms=optimizer_ms)


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


class Sampler:
    """``--sample-prompt``: a short greedy continuation, printed at each evaluation and at
    the end of the run, with the run's own tokenizer.

    Every rank takes part: ``generation.generate`` gathers the vocabulary-parallel logits
    over the TP group and broadcasts TP rank 0's token, so the ranks of a TP group stay in
    step; each DP replica computes the same text and global rank 0 prints it. Greedy, so
    no random numbers are drawn and training is unchanged by it.
    """

    def __init__(self, args: Args, vocab_size: int):
        from .generation import tokenizer_for

        self.tok, stops = tokenizer_for({"data": dataclasses.asdict(args.data)}, vocab_size)
        text = args.log.sample_prompt
        try:
            ids = self.tok.tokenize(text) if text else []
        except ValueError as e:
            raise TrainingError(f"--sample-prompt {text!r}: {e}") from None
        self.prompt, self.show_prompt = (ids, True) if ids else ([self.tok.eod], False)
        self.eod = self.tok.eod if stops else None
        self.tokens = args.log.sample_tokens

    def __call__(self, model, optimizer: Optimizer, device, iteration: int, logger: Logger) -> str:
        from .generation import generate

        with torch.no_grad(), autocast(optimizer, device):
            new = generate(model, self.prompt, self.tokens, eod=self.eod, greedy=True)
        model.train()
        # Prompt and continuation decoded together, so pieces join as they should.
        text = self.tok.detokenize(self.prompt + new if self.show_prompt else new)
        logger.sample(iteration, text)
        return text


class _StopFlag:
    """SIGINT/SIGTERM finish the current step, then the loop exits cleanly."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.requested = True

    def agreed(self) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0], device=ps.comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0


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
        tflops_per_device=flops_tok * tokens_per_sec / dist.get_world_size() / 1e12,
    )
    rec.update(optimizer.stats())
    return rec


def _check_skipped(in_a_row: int, limit: int, iteration: int, out: StepOutput) -> None:
    """fp16: every rank skips the same steps (the overflow test is on the global norm), so
    all of them stop here together, before the step's checkpoint could be saved."""
    if in_a_row >= limit:
        raise TrainingError(
            f"{in_a_row} consecutive steps skipped for fp16 gradient overflow (iterations "
            f"{iteration - in_a_row + 1}-{iteration}, loss {out.loss:.4g}, loss scale "
            f"{out.result.loss_scale:g}): the run is diverging; stopping without saving (lower "
            f"--lr, check the data, or use --bf16; --max-consecutive-skipped-steps sets the "
            f"limit)"
        )


def _check_loss(loss: float, iteration: int) -> None:
    """A non-finite loss stops the run in every precision, before the step's checkpoint
    (under fp16 too: an overflow shows in the gradients, a diverged model in the loss)."""
    if not math.isfinite(loss):
        raise TrainingError(
            f"loss is {loss} at iteration {iteration}: the run is diverging; stopping "
            f"without saving (lower --lr, check the data, or use --bf16)"
        )


def _check_session(skipped: int, steps: int, start: int) -> None:
    """fp16: a run whose steps were all skipped trained nothing (an error); one that
    skipped most of them says so (a run that never learns must not end silently)."""
    if not steps or 2 * skipped <= steps:
        return
    what = (
        f"{skipped} of the {steps} steps of this run (iterations {start + 1}-{start + steps}) "
        f"were skipped for fp16 gradient overflow"
    )
    if skipped == steps:
        raise TrainingError(
            f"{what}: nothing was trained (lower --lr or --initial-loss-scale, or use --bf16)"
        )
    log.info(f"WARNING: {what} (lower --lr or --initial-loss-scale, or use --bf16)")


class _Skips:
    """The fp16 steps skipped for overflow, as the loop counts them: the limit in a row,
    the run's share, and ``good``, the last checkpoint before the current run of skipped
    steps, which the checkpoints taken during that run must not rotate out."""

    def __init__(self, limit: int, start: int):
        self.limit, self.start, self.in_a_row, self.total = limit, start, 0, 0
        self.good = start or None

    def step(self, out: StepOutput, iteration: int) -> None:
        self.in_a_row = self.in_a_row + 1 if out.result.skipped else 0
        self.total += bool(out.result.skipped)
        _check_skipped(self.in_a_row, self.limit, iteration, out)

    def protect(self) -> int | None:
        return self.good if self.in_a_row else None

    def saved(self, iteration: int) -> None:
        if not self.in_a_row:
            self.good = iteration

    def check_run(self, iteration: int) -> None:
        _check_session(self.total, iteration - self.start, self.start)


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
    sampler: Sampler | None = None,
) -> dict:
    """Iterate from ``start_iteration`` to --train-iters (or --exit-interval, or a signal),
    evaluating (and sampling) and saving on their intervals; returns the last iteration's
    record."""
    t = args.train
    dp = ps.get_data_parallel_group()
    num_micro = t.global_batch_size // (t.micro_batch_size * dp.size)
    sched = LRScheduler.from_args(args)
    stop = _StopFlag()
    iteration, last, saved_at = start_iteration, {}, start_iteration
    save_every = args.ckpt.save_interval if args.ckpt.save else None
    end = t.train_iters if t.exit_interval is None else min(t.train_iters, t.exit_interval)
    if t.eval_interval and iteration == 0 and valid_iter is not None:
        # A baseline, so the log shows how far validation loss has come.
        set_phase("the evaluation at iteration 0")
        logger.evaluation(0, "valid", evaluate(model, optimizer, valid_iter, device, t.eval_iters))
        if sampler:
            sampler(model, optimizer, device, 0, logger)
    model.train()
    logger.start_loop(iteration, t.train_iters)
    flops_tok = flops_per_token(
        args.model, args.model.recompute_activations, args.parallel.tensor_model_parallel_size
    )
    skips = _Skips(t.max_consecutive_skipped_steps, start_iteration)
    while iteration < end:
        set_phase(f"iteration {iteration + 1}")
        faults.before_iteration(iteration + 1)
        t0 = time.perf_counter()
        lr = sched.get_lr(consumed_samples)
        try:
            out = train_step(model, optimizer, train_iter, num_micro, lr, dp, device)
        except TrainingError as e:
            raise TrainingError(f"{e} at iteration {iteration}") from None
        iteration += 1
        consumed_samples += t.global_batch_size
        _check_loss(out.loss, iteration)
        skips.step(out, iteration)
        last = _record(
            args,
            iteration,
            consumed_samples,
            lr,
            out,
            optimizer,
            time.perf_counter() - t0,
            flops_tok,
        )
        logger.iteration(last, print_line=iteration % args.log.log_interval == 0)
        if t.eval_interval and iteration % t.eval_interval == 0 and iteration < t.train_iters:
            set_phase(f"the evaluation at iteration {iteration}")
            logger.evaluation(
                iteration, "valid", evaluate(model, optimizer, valid_iter, device, t.eval_iters)
            )
            if sampler:
                sampler(model, optimizer, device, iteration, logger)
        faults.after_iteration(iteration)
        if save_every and iteration % save_every == 0:
            _save(args, iteration, consumed_samples, model, optimizer, skips)
            saved_at = iteration
        if stop.agreed():
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
    """Parse and validate the flags on every rank before any collective (fail() on error)."""
    try:
        args = parse_args(argv)
    except ConfigError as e:
        fail(str(e))
    world = env_int("WORLD_SIZE", 1)
    if args.parallel.world_size is not None:  # a dry run plans for any size; a real run
        if not args.train.dry_run and args.parallel.world_size != world:  # must agree
            fail(
                f"--world-size {args.parallel.world_size} disagrees with the launcher's "
                f"WORLD_SIZE {world} (--world-size is for --dry-run)"
            )
        world = args.parallel.world_size
    try:
        resolve(args, world, given_flags(argv))
    except ConfigError as e:
        fail(str(e))
    return args, world


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
        f"optimizer={args.optim.optimizer}"
        f"{' (cpu offload)' if args.optim.cpu_offload else ''}"
    )
    report = optimizer.memory_report()
    if report:
        log.info(report)
    return model, optimizer


def _run(args: Args, device, logger: Logger, tokenizer=None) -> dict:
    train_ds, valid_ds, test_ds, vocab = build_datasets(args, tokenizer)
    args.model.vocab_size = vocab
    sampler = Sampler(args, vocab) if args.log.sample_prompt is not None else None
    set_phase("building the model and optimizer")
    model, optimizer = build_model_and_optimizer(args, device)
    set_phase("loading the checkpoint")
    start, consumed = _maybe_load(args, model, optimizer)
    _check_resume(args, start)
    # Validation batches continue where the uninterrupted run would be (baseline + evals).
    t = args.train
    per_eval = t.eval_iters * t.micro_batch_size * ps.get_data_parallel_world_size()
    valid_consumed = (start // t.eval_interval + 1) * per_eval if start and t.eval_interval else 0
    train_iter = batch_iterator(train_ds, args, consumed, device)
    valid_iter = batch_iterator(valid_ds, args, valid_consumed, device)
    summary = train(
        args, model, optimizer, train_iter, valid_iter, device, logger, start, consumed, sampler
    )
    if summary.get("iteration", 0) >= t.train_iters:
        set_phase("the final evaluation")
        for name, ds in (("valid", valid_ds), ("test", test_ds)):
            logger.evaluation(
                summary["iteration"],
                name,
                evaluate(
                    model, optimizer, batch_iterator(ds, args, 0, device), device, t.eval_iters
                ),
            )
    if sampler:
        sampler(model, optimizer, device, summary["iteration"], logger)
    log.info(run_summary(args, logger, summary, start, consumed))
    return summary


def run_summary(
    args: Args, logger: Logger, summary: dict, start_iteration: int, start_consumed: int
) -> str:
    """The lines that end a run: time, tokens, final losses and the checkpoint."""
    seq, it = args.model.seq_length, summary["iteration"]
    seconds = time.time() - logger.start
    session = (summary["consumed_samples"] - start_consumed) * seq
    losses = ([f"train {summary['loss']:.4f}"] if "loss" in summary else []) + [
        f"{split} {loss:.4f} (ppl {math.exp(min(loss, 50.0)):.1f})"
        for split, loss in logger.last_eval.items()
    ]
    lines = [
        " run summary:",
        f"   iterations  {it}/{args.train.train_iters}"
        f"{f' (resumed at {start_iteration})' if start_iteration else ''}"
        f" in {hms(seconds)} (start-up, training and evaluation)",
        f"   tokens      {summary['consumed_samples'] * seq:,} trained on in all; this "
        f"session {session:,} ({session / max(seconds, 1e-9):,.0f} tokens/s overall)",
        f"   final loss  {' | '.join(losses) or '-'}",
    ]
    if args.ckpt.save and os.path.exists(os.path.join(iter_dir(args.ckpt.save, it), MANIFEST)):
        lines.append(f"   checkpoint  {args.ckpt.save} (iteration {it})")
    elif args.ckpt.save:
        lines.append(f"   checkpoint  none written to {args.ckpt.save} (no step was taken)")
    return "\n".join(lines)


def flat_config(args: Args) -> dict:
    """Every field of every group in one dict (the W&B run config)."""
    return {k: v for group in vars(args).values() for k, v in dataclasses.asdict(group).items()}


def write_run_config(args: Args) -> str | None:
    """``<--save>/config.yaml``: the resolved configuration, readable by ``--config``.
    Returns an error message instead of raising (the caller makes every rank agree)."""
    if not args.ckpt.save:
        return None
    path = os.path.join(args.ckpt.save, "config.yaml")
    try:
        text = dump_config(args)
    except ImportError:
        log.info("PyYAML is not installed: no config.yaml written (pip install pyyaml)")
        return None
    try:
        os.makedirs(args.ckpt.save, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        return f"--save {args.ckpt.save}: cannot write config.yaml ({e.strerror or e})"
    log.info(f"configuration written to {path} (rerun: pretrain_gpt.py --config {path})")
    return None


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
    ps.initialize_model_parallel(
        p.tensor_model_parallel_size, timedelta(minutes=p.distributed_timeout_minutes)
    )
    log.info(apply_cpu_threads(threads_per_rank(p.cpu_threads_per_rank)))
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
        from .plan import dry_run  # deferred: only the planner needs it

        dry_run(args, world)
        return {}
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
        error = first_error(write_run_config(args) if dist.get_rank() == 0 else None)
        if error:
            fail(error, code=1)
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
