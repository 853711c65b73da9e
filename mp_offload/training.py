"""The pretraining loop; ``pretrain_gpt.py`` is a thin entry point over ``pretrain``.

Order of one run: parse + validate flags (every rank, before any collective) ->
process groups -> data (which fixes the vocabulary) -> model (fp32 on the CPU, the
same full weights for every TP size) -> optimizer (which places the model on the
device in the compute dtype) -> iterations -> final evaluation.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import faults
from . import parallel_state as ps
from .checkpoint import CheckpointError, load_checkpoint, prepare_save, save_checkpoint
from .config import Args, ConfigError, parse_args, validate
from .data.loader import BatchIterator, MockGPTDataset
from .logger import Logger
from .lr_scheduler import LRScheduler
from .model.gpt import GPTModel, flops_per_token, num_parameters
from .optimizer import build_optimizer
from .tensor_parallel import model_parallel_seed


class TrainingError(RuntimeError):
    """Stops the run with a message (NaN loss, data exhausted...)."""


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


CONFIG_ERROR_LINGER_S = 3.0


def fail(msg: str, code: int = 2) -> None:
    # One write(2) of the whole line: ranks share the launcher's stderr pipe, and print()'s
    # separate writes of text and newline can interleave into one garbled line.
    sys.stderr.flush()
    os.write(2, f"pretrain_gpt.py: error: {msg}\n".encode())
    if code == 2 and _env_int("WORLD_SIZE", 1) > 1:
        # torchrun stops all workers when the first one exits; linger briefly so sibling
        # ranks still importing reach validation and print their own reason too.
        time.sleep(CONFIG_ERROR_LINGER_S)
    sys.exit(code)


def init_distributed() -> torch.device:
    """Join the torchrun world (a single process also works): NCCL on CUDA, gloo on CPU."""
    local_rank = _env_int("LOCAL_RANK", 0)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads is None:  # ranks on one host must not oversubscribe the cores
            n = max(1, len(os.sched_getaffinity(0)) // _env_int("LOCAL_WORLD_SIZE", 1))
            torch.set_num_threads(n)
    if not dist.is_initialized():
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is None:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            dist.init_process_group(backend, rank=rank, world_size=world)
        else:
            # After `torchrun --max-restarts` the agent's store may still hold the dead
            # attempt's addresses (seen with gloo: peers dial stale ports); key by attempt.
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  world, is_master=not agent and rank == 0,
                                  timeout=timedelta(minutes=30))
            dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{restart}", store),
                                    rank=rank, world_size=world)
    return device


def _num_samples(args: Args) -> tuple[int, int, int]:
    t = args.train
    gbs, iters = t.global_batch_size, t.train_iters
    evals = (iters // t.eval_interval + 2) * t.eval_iters * gbs
    return iters * gbs, evals, t.eval_iters * gbs


def build_datasets(args: Args):
    """(train, valid, test, vocab_size); only global rank 0 builds caches first."""
    d, m, t = args.data, args.model, args.train
    n_train, n_valid, n_test = _num_samples(args)
    if d.mock_data:
        mk = lambda n, k: MockGPTDataset(max(n, 1), m.seq_length, m.vocab_size, t.seed + k)  # noqa
        return mk(n_train, 0), mk(n_valid, 1), mk(n_test, 2), m.vocab_size
    from .data.gpt_dataset import build_train_valid_test_datasets
    from .data.tokenizer import build_tokenizer

    cache = d.data_cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "mp_offload")
    data_path, tok_model = d.data_path, d.tokenizer_model
    if data_path is None:  # the embedded default corpus: the stdlib's own sources
        from .data.default_corpus import prepare_default_corpus
        if dist.get_rank() == 0:
            prepare_default_corpus(cache, log=lambda s: print(f"[default corpus] {s}", flush=True))
        dist.barrier()
        data_path, tok_model = prepare_default_corpus(cache)
        data_path = [data_path]
    tok = build_tokenizer(d.tokenizer_type, tok_model, vocab_size=m.vocab_size,
                          vocab_file=d.vocab_file, merge_file=d.merge_file)
    datasets = (None, None, None)
    is_reader = ps.get_tensor_model_parallel_rank() == 0
    for turn in (0, 1):  # rank 0 builds the index caches, then the other readers load them
        if is_reader and (dist.get_rank() == 0) == (turn == 0):
            datasets = build_train_valid_test_datasets(
                data_path, d.split, (n_train, n_valid, n_test), m.seq_length, t.seed,
                cache_dir=d.data_cache_dir)
        dist.barrier()
    # Non-readers hold no datasets: learn from TP rank 0 which splits exist.
    present = torch.tensor([ds is not None for ds in datasets], dtype=torch.int64,
                           device=ps.comm_device())
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.broadcast(present, ps.get_tensor_model_parallel_src_rank(),
                       group=ps.get_tensor_model_parallel_group().torch_group())
    datasets = tuple(ds if is_reader else (True if p else None)
                     for ds, p in zip(datasets, present.tolist()))
    return (*datasets, tok.vocab_size)


def _batches(dataset, args, consumed, device):
    """``dataset`` is None when the split is empty (on non-readers: True when it exists)."""
    if dataset is None:
        return None
    return BatchIterator(dataset, consumed, args.train.micro_batch_size,
                         ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                         args.model.seq_length, device, ps.get_tensor_model_parallel_group(),
                         ps.get_tensor_model_parallel_src_rank(),
                         is_reader=ps.get_tensor_model_parallel_rank() == 0)


def _dp_mean(value: torch.Tensor) -> float:
    v = value.detach().float().reshape(1).clone()
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(v, group=ps.get_data_parallel_group().torch_group())
    return float(v.item()) / ps.get_data_parallel_world_size()


def _autocast(optimizer, device):
    dtype = optimizer.autocast_dtype
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def evaluate(model, optimizer, batches, device, num_iters: int) -> float | None:
    if batches is None:
        return None
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad(), _autocast(optimizer, device):
        for _ in range(num_iters):
            try:
                tokens = next(batches)
            except StopIteration:
                break
            total += _dp_mean(model(tokens[:, :-1], tokens[:, 1:]).mean())
            n += 1
    model.train()
    return total / n if n else None


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


def _save(args: Args, iteration: int, consumed: int, model, optimizer, logger) -> None:
    t0 = time.perf_counter()
    path = save_checkpoint(args.ckpt.save, iteration, consumed, model, optimizer, args,
                           keep=args.ckpt.keep_checkpoints)
    logger.info(f"saved checkpoint {path} in {time.perf_counter() - t0:.1f}s")


def train(args: Args, model, optimizer, train_iter, valid_iter, device, logger: Logger,
          start_iteration: int = 0, consumed_samples: int = 0) -> dict:
    t = args.train
    world = dist.get_world_size()
    dp = ps.get_data_parallel_world_size()
    num_micro = t.global_batch_size // (t.micro_batch_size * dp)
    sched = LRScheduler.from_args(args)
    tp = args.parallel.tensor_model_parallel_size
    flops_tok = flops_per_token(args.model, args.model.recompute_activations, tp)
    stop = _StopFlag()
    iteration, last, saved_at = start_iteration, {}, start_iteration
    # fp16 skips so far (restored with the loss scaler on resume)
    save_every = args.ckpt.save_interval if args.ckpt.save else None
    end = t.train_iters if t.exit_interval is None else min(t.train_iters, t.exit_interval)
    if t.eval_interval and iteration == 0 and valid_iter is not None:
        # A baseline, so the log shows how far validation loss has come.
        logger.evaluation(0, "valid", evaluate(model, optimizer, valid_iter, device, t.eval_iters))
    model.train()
    while iteration < end:
        t0 = time.perf_counter()
        lr = sched.get_lr(consumed_samples)
        optimizer.zero_grad()
        loss_sum = torch.zeros((), device=device)
        for _ in range(num_micro):
            try:
                tokens = next(train_iter)
            except StopIteration:
                raise TrainingError(f"training data ran out at iteration {iteration}") from None
            with _autocast(optimizer, device):
                loss = model(tokens[:, :-1], tokens[:, 1:]).mean() / num_micro
            optimizer.backward(loss)
            loss_sum += loss.detach()
        result = optimizer.step(lr)
        iteration += 1
        consumed_samples += t.global_batch_size
        loss_val = _dp_mean(loss_sum)
        if not math.isfinite(loss_val) and not t.fp16:
            raise TrainingError(f"loss is {loss_val} at iteration {iteration}; stopping "
                                f"(lower --lr, check the data, or use --fp16/--bf16 carefully)")
        elapsed = time.perf_counter() - t0
        tokens_per_sec = t.global_batch_size * args.model.seq_length / elapsed
        last = dict(iteration=iteration, consumed_samples=consumed_samples, loss=loss_val,
                    lr=lr, grad_norm=result.grad_norm, loss_scale=result.loss_scale,
                    skipped_iterations=optimizer.skipped_steps, tokens_per_sec=tokens_per_sec,
                    elapsed_ms=elapsed * 1e3,
                    tflops_per_device=flops_tok * tokens_per_sec / world / 1e12)
        last.update(optimizer.stats())
        logger.iteration(last, print_line=iteration % args.log.log_interval == 0)
        if t.eval_interval and iteration % t.eval_interval == 0 and iteration < t.train_iters:
            logger.evaluation(iteration, "valid",
                              evaluate(model, optimizer, valid_iter, device, t.eval_iters))
        faults.after_iteration(iteration)
        if save_every and iteration % save_every == 0:
            _save(args, iteration, consumed_samples, model, optimizer, logger)
            saved_at = iteration
        if stop.agreed():
            logger.info(f"stop requested: exiting after iteration {iteration}")
            break
    optimizer.flush()
    if args.ckpt.save and saved_at != iteration:
        _save(args, iteration, consumed_samples, model, optimizer, logger)
    return dict(last, iteration=iteration, consumed_samples=consumed_samples)


def _maybe_load(args: Args, model, optimizer, logger) -> tuple[int, int]:
    c = args.ckpt
    if not c.load:
        return 0, 0
    weights_only = c.finetune or c.no_load_optim
    res = load_checkpoint(c.load, model, optimizer, args, load_optim=not weights_only,
                          load_rng=not (c.finetune or c.no_load_rng), log=logger.info)
    if res is None:
        logger.info(f"no checkpoint in {c.load}: starting from scratch")
        return 0, 0
    logger.info(f"loaded checkpoint from {c.load} at iteration {res[0]}"
                f"{' (weights only)' if weights_only else ''}")
    return (0, 0) if c.finetune else res


def pretrain(argv=None) -> dict:
    args = parse_args(argv)
    world = _env_int("WORLD_SIZE", 1)
    if args.parallel.world_size is not None:  # a dry run plans for any size; a real run
        if not args.train.dry_run and args.parallel.world_size != world:  # must agree
            fail(f"--world-size {args.parallel.world_size} disagrees with the launcher's "
                 f"WORLD_SIZE {world} (--world-size is for --dry-run)")
        world = args.parallel.world_size
    try:
        validate(args, world)
    except ConfigError as e:
        fail(str(e))
    if args.train.dry_run:
        from .plan import dry_run  # noqa: deferred: only the planner needs it
        dry_run(args, world)
        return {}
    device = init_distributed()
    ps.initialize_model_parallel(args.parallel.tensor_model_parallel_size)
    logger = Logger(args.log, is_main=dist.get_rank() == 0)
    lock = None
    try:
        try:  # before anything is built: a bad --save/--load pair must cost nothing
            lock = prepare_save(args.ckpt, log=logger.info)
        except CheckpointError as e:
            fail(str(e))  # status 2, like a bad flag: nothing ran
        train_ds, valid_ds, test_ds, vocab = build_datasets(args)
        args.model.vocab_size = vocab
        torch.manual_seed(args.train.seed)  # the full weights: identical for every TP size
        model = GPTModel(args.model)
        model_parallel_seed(args.train.seed, ps.get_tensor_model_parallel_rank(), device.type)
        optimizer = build_optimizer(model, args, device)
        tp = args.parallel.tensor_model_parallel_size
        logger.info(f"GPT: {num_parameters(args.model, tp) / 1e6:.2f}M parameters, "
                    f"TP={tp} DP={ps.get_data_parallel_world_size()} device={device.type} "
                    f"optimizer={args.optim.optimizer}"
                    f"{' (cpu offload)' if args.optim.cpu_offload else ''}")
        report = optimizer.memory_report()
        if report:
            logger.info(report)
        start, consumed = _maybe_load(args, model, optimizer, logger)
        # Validation batches continue where the uninterrupted run would be (baseline + evals).
        t = args.train
        per_eval = t.eval_iters * t.micro_batch_size * ps.get_data_parallel_world_size()
        valid_consumed = (start // t.eval_interval + 1) * per_eval \
            if start and t.eval_interval else 0
        train_iter = _batches(train_ds, args, consumed, device)
        valid_iter = _batches(valid_ds, args, valid_consumed, device)
        summary = train(args, model, optimizer, train_iter, valid_iter, device, logger,
                        start, consumed)
        if summary.get("iteration", 0) >= args.train.train_iters:
            for name, ds in (("valid", valid_ds), ("test", test_ds)):
                logger.evaluation(summary["iteration"], name,
                                  evaluate(model, optimizer, _batches(ds, args, 0, device),
                                           device, args.train.eval_iters))
        return summary
    except (TrainingError, CheckpointError) as e:
        fail(str(e), code=1)
    finally:
        if lock is not None:
            lock.release()
        logger.close()
        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
