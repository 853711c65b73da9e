"""Run a function on N gloo ranks (spawned processes) and surface their errors; the
checkpoint tests' runs and their JSON logs."""

from __future__ import annotations

import json
import os
import socket
from multiprocessing import reduction

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import CKPT_RUN


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks start from a fork server that has torch and the training loop imported already:
# a spawned rank spent 2-8 s importing them, the largest cost of the multi-process tests.
# Forked ranks inherit the server's environment and directory, so each rank takes the
# caller's (as a spawned one would).
mp.set_forkserver_preload(["torch", "mp_offload.training", "dist_helpers"])


class _CallerOutput:
    """The caller's stdout and stderr, handed to each forked rank as it starts (a fork
    server's own are those of whichever test started it, e.g. another test's capture)."""

    def __reduce__(self):
        return _take_output, (reduction.DupFd(1), reduction.DupFd(2))


def _take_output(out, err):
    os.dup2(out.detach(), 1)
    os.dup2(err.detach(), 2)


def _entry(rank, world, port, env, cwd, output, fn, args):
    del output  # the caller's fds are already ours: unpickling it took them (_take_output)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        from mp_offload import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():  # pretrain() tears its own group down
            dist.destroy_process_group()


def run_distributed(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; re-raise any failure."""
    mp.start_processes(
        _entry,
        args=(world, free_port(), dict(os.environ), os.getcwd(), _CallerOutput(), fn, args),
        nprocs=world,
        join=True,
        start_method="forkserver",
    )


def loss_and_grads(model, x, y):
    """One fp32 forward/backward: (the loss, {parameter name: its gradient})."""
    model.zero_grad()
    loss = model(x, y).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def merged_grad(param, group):
    """``param``'s gradient as the unsplit model has it: a TP-split parameter's shards are
    gathered over ``group`` (a ParallelGroup) and merged."""
    from mp_offload.tensor_parallel import merge_partitions

    if not param.tensor_model_parallel or group.size == 1:
        return param.grad
    parts = [torch.empty_like(param.grad) for _ in range(group.size)]
    dist.all_gather(parts, param.grad.contiguous(), group=group.torch_group())
    return merge_partitions(parts, param.partition_dim, param.partition_stride)


def pretrain_worker(rank, world, argv):
    """``run_distributed`` target: one rank of ``pretrain_gpt.py argv``."""
    from mp_offload.training import pretrain

    pretrain(argv)


def ckpt_run(world: int, tp: int, *extra) -> None:
    """``pretrain_gpt.py`` on ``world`` ranks at TP=``tp``: helpers.CKPT_RUN plus ``extra``
    (the checkpoint tests' runs)."""
    run_distributed(
        pretrain_worker, world, CKPT_RUN + ["--tensor-model-parallel-size", str(tp), *extra]
    )


def log_records(path) -> list:
    """The records of a ``--log-json`` file."""
    with open(path) as f:
        return [json.loads(line) for line in f]


_VOLATILE = ("elapsed_ms", "optimizer_ms", "device_tail_ms", "tokens_per_sec")
_VOLATILE += ("tflops_per_device", "peak_device_gb", "peak_host_gb")


def stable_records(path, resumed: bool = False) -> list:
    """A --log-json file's records less the timings (and, for a resumed run, the bytes per
    param: the load's publish moved bytes too): what two runs of one training share."""
    drop = _VOLATILE + (("host_device_bytes_per_param",) if resumed else ())
    return [
        {k: v for k, v in r.items() if k not in drop and not k.startswith("phase_")}
        for r in log_records(path)
    ]


def log_losses(path) -> dict:
    """``{iteration: loss}`` of a ``--log-json`` file."""
    return {r["iteration"]: r["loss"] for r in log_records(path) if "loss" in r}
