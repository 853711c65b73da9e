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


def init_distributed() -> torch.device:
    """Join the torchrun world (a single process also works): NCCL on CUDA, gloo on CPU."""
    local_rank = env_int("LOCAL_RANK", 0)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads is None:  # ranks on one host must not oversubscribe the cores
            n = max(1, len(os.sched_getaffinity(0)) // env_int("LOCAL_WORLD_SIZE", 1))
            torch.set_num_threads(n)
    if not dist.is_initialized():
        rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
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


def first_error(error: str | None) -> str | None:
    """Collective: the first non-empty error of any rank (or None), on every rank.

    Whatever can fail must run before this call, so no rank is left waiting elsewhere.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)
