"""Process-group start-up and the rule every rank follows on errors.

``init_distributed`` joins the torchrun world (NCCL on CUDA, gloo on CPU; a lone
process also works). ``first_error`` is the one collective through which ranks share
what went wrong, so that a failure on one rank is raised on every rank instead of
leaving the others waiting in the next collective. ``fail`` prints one line and exits.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


CONFIG_ERROR_LINGER_S = 3.0


def fail(msg: str, code: int = 2) -> None:
    # One write(2) of the whole line: ranks share the launcher's stderr pipe, and print()'s
    # separate writes of text and newline can interleave into one garbled line.
    sys.stderr.flush()
    os.write(2, f"pretrain_gpt.py: error: {msg}\n".encode())
    if code == 2 and env_int("WORLD_SIZE", 1) > 1:
        # torchrun stops all workers when the first one exits; linger briefly so sibling
        # ranks still importing reach validation and print their own reason too.
        time.sleep(CONFIG_ERROR_LINGER_S)
    sys.exit(code)


class DeviceError(RuntimeError):
    """The requested device cannot be used by this rank; the message says why and what to do."""


DEVICE_ENV = "MP_OFFLOAD_DEVICE"


def pick_device(choice: str | None = None) -> torch.device:
    """This rank's device: ``--device`` (``choice``), else $MP_OFFLOAD_DEVICE, else auto.

    auto: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU. A rank whose
    LOCAL_RANK has no GPU is refused by name instead of dying on "invalid device ordinal".
    """
    choice = choice or os.environ.get(DEVICE_ENV) or "auto"
    if choice not in ("auto", "cuda", "cpu"):
        raise DeviceError(f"--device/{DEVICE_ENV} must be auto, cuda or cpu, got {choice!r}")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError("--device cuda: no CUDA device is available (use --device cpu)")
    local_rank, count = env_int("LOCAL_RANK", 0), torch.cuda.device_count()
    if local_rank >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise DeviceError(f"LOCAL_RANK {local_rank} has no GPU: {count} visible{seen}; start at "
                          f"most {count} processes per node (torchrun --nproc-per-node {count}) "
                          f"or run on the CPU with --device cpu or {DEVICE_ENV}=cpu")
    return torch.device("cuda", local_rank)


def threads_per_rank(requested: int | None = None) -> int:
    """CPU threads for this rank's host work (C++ Adam, torch intra-op).

    Default: the cores in this process's affinity mask shared among the ranks of the node
    (LOCAL_WORLD_SIZE). OMP_NUM_THREADS is ignored on purpose: torchrun sets it to 1 for
    every multi-process job, which would leave the CPU Adam on one core per rank.
    """
    if requested is not None:
        if requested < 1:
            raise DeviceError(f"--cpu-threads-per-rank must be >= 1, got {requested}")
        return requested
    return max(1, len(os.sched_getaffinity(0)) // max(1, env_int("LOCAL_WORLD_SIZE", 1)))


def apply_cpu_threads(n: int) -> str:
    """Give the C++ Adam and torch's intra-op pool ``n`` threads; returns a one-line report."""
    torch.set_num_threads(n)
    try:
        from .ops.cpu_adam import set_num_threads, simd_level
    except ImportError:
        return (f"host threads {n}; WARNING: the C++ CPU Adam is not built, the optimizer "
                f"falls back to torch ops (several times slower): run `pip install -e .`")
    set_num_threads(n)
    from .ops import host_ops
    host_ops.set_num_threads(n)
    return f"host threads {n}; CPU Adam {simd_level()}"


def init_distributed(device: str | None = None, timeout_minutes: float = 10.0) -> torch.device:
    """Join the torchrun world (a single process also works): NCCL on CUDA, gloo on CPU.

    ``timeout_minutes`` bounds every collective, so a stalled rank ends the job with an
    error instead of hanging it for torch's default half hour.
    """
    dev = pick_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
        timeout = timedelta(minutes=timeout_minutes)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is None:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        else:
            # After `torchrun --max-restarts` the agent's store may still hold the dead
            # attempt's addresses (seen with gloo: peers dial stale ports); key by attempt.
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  world, is_master=not agent and rank == 0, timeout=timeout)
            dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{restart}", store),
                                    rank=rank, world_size=world, timeout=timeout)
    return dev


def first_error(error: str | None) -> str | None:
    """Collective: the first non-empty error of any rank (or None), on every rank.

    Whatever can fail must run before this call, so no rank is left waiting elsewhere.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)
