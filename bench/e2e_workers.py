"""The processes that bench_e2e.py launches under torchrun: the DDP baseline loop, and the
paired loop that alternates DDP and ours iteration by iteration with timers around the
ZeRO optimizer's pieces. Kept apart so the launcher stays readable.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import defaultdict


class Phases:
    """Exclusive wall time per named phase: a wrapped call's time minus its wrapped callees'.

    Stacks are thread-local, so a phase running in a helper thread is counted on its own
    and never subtracted from the main thread's phases.
    """

    def __init__(self):
        self.total = defaultdict(float)
        self._local = threading.local()

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            stack = self._local.__dict__.setdefault("stack", [])
            stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                child = stack.pop()
                if stack:
                    stack[-1] += elapsed
                self.total[name] += elapsed - child

        timed.__wrapped__ = fn
        return timed

    @contextlib.contextmanager
    def section(self, name):
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(0.0)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - t0
            child = stack.pop()
            if stack:
                stack[-1] += elapsed
            self.total[name] += elapsed - child

    def cut(self) -> dict:
        """The phases since the last cut, in ms; starts a new count."""
        out = {k: v * 1e3 for k, v in self.total.items()}
        self.total.clear()
        return out


def instrument(ph: Phases, model, opt) -> None:
    """Time our run's pieces through the optimizer's own phase hook (no method patched) and
    the model's forward through module hooks."""
    opt.set_phase_timer(ph.section)
    open_sections = []

    def enter(*_):
        open_sections.append(ph.section("forward"))
        open_sections[-1].__enter__()

    def leave(*_):
        open_sections.pop().__exit__(None, None, None)  # returns None: the output stays

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)


def _split_worker_argv(argv):
    """``--worker KIND [--out FILE] [--warmup N] -- <pretrain flags>``."""
    sep = argv.index("--")
    head, rest = argv[:sep], argv[sep + 1 :]
    return dict(zip(head[::2], head[1::2])), rest


def _setup(pretrain_argv):
    """Flags, process groups and the training split, in pretrain()'s order."""
    from mp_offload import parallel_state as ps
    from mp_offload.config import parse, resolve
    from mp_offload.data.build import build_datasets
    from mp_offload.runtime.distributed import init_distributed
    from mp_offload.training import with_data

    args, given = parse(pretrain_argv)
    args = resolve(args, int(os.environ.get("WORLD_SIZE", 1)), given)
    device = init_distributed()
    ps.initialize_model_parallel(args.parallel.tensor_model_parallel_size)
    data = build_datasets(args)
    return with_data(args, data), device, data.train


def _build_model(args, device):
    """The GPT exactly as pretrain() builds it; returns it and its RNG streams afterwards."""
    import torch

    from mp_offload import parallel_state as ps
    from mp_offload.model.gpt import GPTModel
    from mp_offload.tensor_parallel import get_rng_tracker, model_parallel_seed

    torch.manual_seed(args.train.seed)
    model = GPTModel(args.model)
    model_parallel_seed(args.train.seed, ps.get_tensor_model_parallel_rank(), device.type)
    return model, [torch.get_rng_state(), get_rng_tracker().get_states()]


def _batches(args, train_ds, device):
    from mp_offload.data.build import batch_iterator

    return batch_iterator(train_ds, args, 0, device)


class DDPTrainer:
    """Plain PyTorch data parallelism: DDP + AdamW(fused=True), our schedule and clipping."""

    def __init__(self, args, device, model, train_ds, ph: Phases | None = None):
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from mp_offload import parallel_state as ps
        from mp_offload.lr_scheduler import LRScheduler
        from mp_offload.optimizer.torch_adamw import param_groups

        t, o = args.train, args.optim
        self.args, self.device, self.ph = args, device, ph or Phases()
        model.to(device)
        self.ddp = DDP(model)
        self.params = list(model.parameters())
        self.opt = torch.optim.AdamW(
            param_groups(model, o.weight_decay),
            lr=o.lr,
            betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps,
            fused=True,
        )
        self.dp = ps.get_data_parallel_world_size()
        self.num_micro = t.global_batch_size // (t.micro_batch_size * self.dp)
        self.sched = LRScheduler.from_args(args)
        self.batches = _batches(args, train_ds, device)
        self.consumed = 0

    def iteration(self) -> float:
        import torch
        import torch.distributed as dist

        t, ph = self.args.train, self.ph
        clip = self.args.optim.clip_grad
        for g in self.opt.param_groups:
            g["lr"] = self.sched.get_lr(self.consumed)
        self.opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for k in range(self.num_micro):
            tokens = next(self.batches)
            with (
                torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=t.bf16),
                ph.section("forward"),
            ):
                loss = self.ddp(tokens[:, :-1], tokens[:, 1:]).mean() / self.num_micro
            sync = contextlib.nullcontext() if k == self.num_micro - 1 else self.ddp.no_sync()
            with sync, ph.section("backward (+ overlapped DDP all-reduce)"):
                loss.backward()
            loss_sum += loss.detach()
        with ph.section("clip (grad norm)"):
            torch.nn.utils.clip_grad_norm_(self.params, clip if clip > 0 else float("inf"))
        with ph.section("AdamW(fused=True) step, all params"):
            self.opt.step()
        dist.all_reduce(loss_sum)  # the same logging all-reduce as ours
        self.consumed += t.global_batch_size
        return loss_sum.item() / self.dp


class OursTrainer:
    """One iteration of mp_offload.training.train(): its very train_step, for the paired run."""

    def __init__(self, args, device, model, train_ds):
        from mp_offload import parallel_state as ps
        from mp_offload.lr_scheduler import LRScheduler
        from mp_offload.optimizer import build_optimizer

        t = args.train
        self.args, self.device = args, device
        self.opt = build_optimizer(model, args, device)
        self.model = model
        self.dp = ps.get_data_parallel_group()
        self.num_micro = t.global_batch_size // (t.micro_batch_size * self.dp.size)
        self.sched = LRScheduler.from_args(args)
        self.batches = _batches(args, train_ds, device)
        self.consumed = 0

    def iteration(self) -> float:
        from mp_offload.training import train_step

        lr = self.sched.get_lr(self.consumed)
        out = train_step(
            self.model, self.opt, self.batches, self.num_micro, lr, self.dp, self.device
        )
        self.consumed += self.args.train.global_batch_size
        return out.loss


def _teardown():
    import torch.distributed as dist

    from mp_offload import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def worker_ddp(pretrain_argv):
    """Part 1's baseline run: logs one JSON object per iteration, as pretrain() does."""
    import torch.distributed as dist

    args, device, train_ds = _setup(pretrain_argv)
    model, _ = _build_model(args, device)
    ph = Phases()
    trainer = DDPTrainer(args, device, model, train_ds, ph)
    t = args.train
    log = open(args.log.log_json, "a") if dist.get_rank() == 0 and args.log.log_json else None
    for it in range(1, t.train_iters + 1):
        t0 = time.perf_counter()
        loss = trainer.iteration()
        elapsed = time.perf_counter() - t0
        if log:
            log.write(
                json.dumps(
                    dict(
                        iteration=it,
                        loss=loss,
                        elapsed_ms=elapsed * 1e3,
                        tokens_per_sec=t.global_batch_size * args.model.seq_length / elapsed,
                        phases_ms=ph.cut(),
                    )
                )
                + "\n"
            )
            log.flush()
    if log:
        log.close()
    _teardown()


def worker_pair(pretrain_argv, out_path):
    """Part 2: DDP and ours alternating iteration by iteration in the same processes."""
    import torch
    import torch.distributed as dist

    from mp_offload.tensor_parallel import get_rng_tracker

    ph = Phases()
    args, device, train_ds = _setup(pretrain_argv)
    model_b, rng_b = _build_model(args, device)
    ddp = DDPTrainer(args, device, model_b, train_ds, ph)
    model_a, rng_a = _build_model(args, device)
    ours = OursTrainer(args, device, model_a, train_ds)
    instrument(ph, model_a, ours.opt)
    trainers = {"ddp": (ddp, rng_b), "offload": (ours, rng_a)}
    ph.cut()
    records = []
    tracker = get_rng_tracker()
    for it in range(1, args.train.train_iters + 1):
        order = ("ddp", "offload") if it % 2 else ("offload", "ddp")  # ABBA: no order bias
        for who in order:
            trainer, rng = trainers[who]
            torch.set_rng_state(rng[0])  # each model keeps its own dropout streams
            tracker.set_states(rng[1])
            t0 = time.perf_counter()
            loss = trainer.iteration()
            elapsed = time.perf_counter() - t0
            rng[0], rng[1] = torch.get_rng_state(), tracker.get_states()
            records.append(
                dict(who=who, iteration=it, elapsed_ms=elapsed * 1e3, loss=loss, phases_ms=ph.cut())
            )
    if hasattr(ours.opt, "flush"):
        ours.opt.flush()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(records, f)
    _teardown()


# ============================================================== the driver (one process)
