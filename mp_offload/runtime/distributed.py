"""Process-group start-up and the rule every rank follows on errors.

``init_distributed`` joins the torchrun world (NCCL on CUDA, gloo on CPU; a lone
process also works) through a rendezvous that says what it waits for and gives up
after --distributed-timeout-minutes. ``first_error`` (and ``agreed`` on top of it) is
the one collective through which ranks share what went wrong, so that a failure on
one rank is raised on every rank instead of leaving the others waiting in the next
collective. ``fail`` prints the reason once for the whole job and exits;
``comm_failure`` turns a failed collective into a line naming what was waited for.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .cpu_threads import (
    available_cores,
    busy_machine,
    default_threads_per_rank,
    openmp_wait,
    other_runnable,
)
from .early_exit import PROG, reporting_rank, say, wait_for_the_launcher
from .numa import Binding, bind_to_gpu


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


_BINDING = Binding()  # this rank's NUMA binding (``init_distributed``)
_STORE = None  # the rendezvous store: ranks claim the one report of a failure there
_TIMEOUT_MINUTES = 10.0
_PHASE = "start-up"


def set_phase(what: str) -> None:
    """What the job is doing now (\"iteration 12\"): a failed collective names it."""
    global _PHASE
    _PHASE = what


def current_phase() -> str:
    return _PHASE


def is_reporting_rank() -> bool:
    """Global rank 0; before the process group exists, LOCAL_RANK 0 (else RANK 0), which
    is the same process on one node and one line per node's log on several."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return reporting_rank()


def _claim_report() -> bool:
    """True for the first rank of the job to report a failure (the store decides);
    True as well when there is no store to ask."""
    if _STORE is None:
        return True
    try:
        return _STORE.add("mp_offload/reported", 1) == 1
    except Exception:  # noqa: BLE001 - the store may have died with its host rank
        return True


def claim_report() -> None:
    """Mark the failure as reported (before a traceback), so the ranks that lose contact
    with this one stay quiet instead of burying it."""
    _claim_report()


def _quiet_barrier() -> None:
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def fail(msg: str, code: int = 2, *, everywhere: bool = True) -> None:
    """Exit with ``code`` (2: bad configuration or input, 1: run-time failure), ``msg``
    printed once for the job as ``pretrain_gpt.py: error: ...`` (one line per line).

    ``everywhere``: every rank reached this same message (flags, shared through
    ``first_error``): the reporting rank prints it; the others exit quietly once it has
    (after a barrier, or before the process group exists by waiting for the launcher to
    stop them). Otherwise the message is this rank's own: it prints unless another rank
    already reported the failure.
    """
    text = "\n".join(f"{PROG}: error: {line}" for line in msg.splitlines() or [""])
    if everywhere:
        if is_reporting_rank():
            _claim_report()
            say(text)
        if dist.is_initialized():
            _quiet_barrier()
        else:
            wait_for_the_launcher(code)
    elif _claim_report():
        say(text)
    sys.exit(code)


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


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
        raise DeviceError(
            f"LOCAL_RANK {local_rank} has no GPU: {count} visible{seen}; start at "
            f"most {count} processes per node (torchrun --nproc-per-node {count}) "
            f"or run on the CPU with --device cpu or {DEVICE_ENV}=cpu"
        )
    return torch.device("cuda", local_rank)


def threads_per_rank(requested: int | None = None, gpu: bool = False) -> int:
    """CPU threads for this rank's host work: ``--cpu-threads-per-rank`` if given, else
    the one rule of ``cpu_threads.py`` (cores of the affinity mask and cgroup quota per
    rank of the node, one kept for the launching threads on a GPU; a rank bound to its
    GPU's NUMA node shares that node's cores with the ranks bound there)."""
    if requested is not None:
        if requested < 1:
            raise DeviceError(f"--cpu-threads-per-rank must be >= 1, got {requested}")
        return requested
    return default_threads_per_rank(gpu, ranks=_BINDING.ranks)


def collective_timeout_minutes() -> float:
    """``--distributed-timeout-minutes`` as ``init_distributed`` was given it."""
    return _TIMEOUT_MINUTES


def numa_binding() -> Binding:
    """This rank's NUMA binding, made by ``init_distributed`` (unbound off the GPU)."""
    return _BINDING


def numa_report(device: torch.device) -> str:
    """Collective: one line saying where each rank's CPU work is bound (all ranks')."""
    mine = _BINDING.describe(dist.get_rank() if dist.is_initialized() else 0, device)
    lines = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        lines = [None] * dist.get_world_size()
        dist.all_gather_object(lines, mine)
    return "CPU binding: " + "; ".join(lines)


def host_threads(requested: int | None = None, gpu: bool = False) -> tuple[int, str | None]:
    """``threads_per_rank``, and a warning when the machine is busy (``busy_machine``,
    which may lower the count). Every rank of the node calls it at once, just after the
    process groups are made, so the job's own ranks sleep while it counts the other
    jobs' runnable tasks."""
    n = threads_per_rank(requested, gpu)
    ranks = max(1, env_int("LOCAL_WORLD_SIZE", 1))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return busy_machine(ranks, n, available_cores(), other_runnable(), load, requested is not None)


def apply_cpu_threads(n: int) -> str:
    """Give the C++ Adam and torch's intra-op pool ``n`` threads; returns a one-line report."""
    torch.set_num_threads(n)
    try:
        from ..ops.cpu_adam import set_num_threads, simd_level
    except ImportError:
        return (
            f"host threads {n}; WARNING: the C++ CPU Adam is not built, the optimizer "
            f"falls back to torch ops (several times slower): run `pip install -e .`"
        )
    set_num_threads(n)
    from ..ops import host_ops

    host_ops.set_num_threads(n)
    return f"host threads {n}; CPU Adam {simd_level()}; {openmp_wait()}"


class RendezvousError(RuntimeError):
    """The ranks did not all meet (or the address cannot be used); the message says where."""


class StartupError(RuntimeError):
    """A start-up failure that every rank now holds (shared by ``agreed``)."""


def format_minutes(minutes: float) -> str:
    return f"{minutes * 60:g} s" if minutes < 1 else f"{minutes:g} min"


def _wait_line(rank: int, world: int, where: str, joined: int | None) -> str:
    have = "" if joined is None else f" ({joined} of {world} joined)"
    return (
        f"{PROG}: waiting for {world} ranks at {where}{have}; this is rank {rank} "
        f"(MASTER_ADDR:MASTER_PORT, RANK, WORLD_SIZE from the launcher)"
    )


def _wait_for_master(addr: str, port: int, deadline: float, announce) -> None:
    """Until rank 0 listens at addr:port (a plain connect, so torch's client never times
    out with a C++ stack trace); RendezvousError at ``deadline``."""
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return
        except OSError:
            pass
        announce(None)
        if time.monotonic() > deadline:
            raise RendezvousError("rank 0 never listened")
        time.sleep(0.2)


# What torchrun sets in each rank's environment: a process that starts another run (a
# test, a tool) removes them, or the child would join its parent's job.
LAUNCHER_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
    "GROUP_RANK", "ROLE_RANK",
)  # fmt: skip


def without_launcher(env) -> dict:
    """``env`` less torchrun's variables (``LAUNCHER_ENV``)."""
    return {k: v for k, v in env.items() if k not in LAUNCHER_ENV}


def _rendezvous(rank: int, world: int, timeout: timedelta):
    """The store of this attempt once all ``world`` ranks have joined it.

    Rank 0 hosts the store (unless torchrun's agent does); each rank adds itself to a
    counter and waits for the others, printing once what it waits for after a few
    seconds and raising RendezvousError when ``timeout`` passes.
    """
    addr = os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port_text = os.environ.setdefault("MASTER_PORT", "29500")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise RendezvousError(f"MASTER_PORT {port_text!r} is not a port number")
    port, where = int(port_text), f"{addr}:{port_text}"
    # torchrun's agent hosts the store; keyed by attempt, since after --max-restarts it
    # may still hold the dead attempt's addresses (seen with gloo: peers dial stale ports).
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    is_master = not agent and rank == 0
    start = time.monotonic()
    deadline = start + timeout.total_seconds()
    announced = []

    def announce(joined):
        # After a few seconds, once: by the reporting rank, or by a rank left without rank 0
        if announced or time.monotonic() - start < min(10.0, timeout.total_seconds() / 2):
            return
        if joined is None or is_reporting_rank():
            announced.append(True)
            say(_wait_line(rank, world, where, joined))

    joined = 0
    try:
        if not is_master:
            _wait_for_master(addr, port, deadline, announce)
        left = timedelta(seconds=max(1.0, deadline - time.monotonic()))
        store = dist.PrefixStore(
            f"attempt_{attempt}",
            dist.TCPStore(
                addr, port, world, is_master=is_master, timeout=left, wait_for_workers=False
            ),
        )
        store.add("mp_offload/joined", 1)
        while (joined := store.add("mp_offload/joined", 0)) < world:
            announce(joined)
            if time.monotonic() > deadline:
                raise RendezvousError("not everyone joined")
            time.sleep(0.1)
        return store
    except (RendezvousError, RuntimeError) as e:  # torch's DistError is a RuntimeError
        if "address already in use" in str(e).lower():
            raise RendezvousError(
                f"rank {rank} cannot listen at {where}: the port is in use "
                f"(another job? set MASTER_PORT)"
            ) from None
        if not isinstance(e, RendezvousError) and time.monotonic() < deadline:
            raise RendezvousError(
                f"rank {rank}: the rendezvous at {where} failed: {first_line(e)}"
            ) from None
        who = f"{joined} of {world} joined" if is_master or joined else "rank 0 never answered"
        raise RendezvousError(
            f"timed out after {format_minutes(timeout.total_seconds() / 60)} waiting for "
            f"{world} ranks at {where} ({who}; this is rank {rank}): start all {world} "
            f"processes with the same MASTER_ADDR and MASTER_PORT, or WORLD_SIZE=1 for one "
            f"process (--distributed-timeout-minutes sets the wait)"
        ) from None


def store_client(timeout_s: float):
    """This job's rendezvous store (the keys ``_rendezvous`` and ``fail`` use) for a
    thread that must not block while the main one waits in a collective: its calls there
    are quick ``check``/``add``/``get`` of keys that exist. The same client as the process
    group's (a second TCPStore client, torn down at interpreter exit after the process
    group, could abort the process). None for a lone process (its store lives in memory).
    ``timeout_s`` is kept for the callers: the shared client keeps the rendezvous's."""
    del timeout_s
    return _STORE if isinstance(_STORE, dist.PrefixStore) else None


def init_distributed(device: str | None = None, timeout_minutes: float = 10.0) -> torch.device:
    """Join the torchrun world (a single process also works): NCCL on CUDA, gloo on CPU.

    ``timeout_minutes`` bounds the rendezvous and every collective, so a missing or
    stalled rank ends the job with a line saying what was waited for instead of hanging
    it. A lone process needs no address (an in-memory store, no port to collide on).
    """
    global _BINDING, _STORE, _TIMEOUT_MINUTES
    dev = pick_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        # before the process group and the model allocate host memory (first touch)
        _BINDING = bind_to_gpu(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    _TIMEOUT_MINUTES = timeout_minutes
    if not dist.is_initialized():
        rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
        timeout = timedelta(minutes=timeout_minutes)
        set_phase("the rendezvous")
        store = dist.HashStore() if world == 1 else _rendezvous(rank, world, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        _STORE = store
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


def agreed(fn, *, active: bool = True):
    """``fn()`` where ``active``, then a ``first_error`` (also the barrier between phases):
    an error on any rank is raised as StartupError on every rank, named after the rank
    that had it. Catches what bad input and full or unreadable disks raise."""
    result, error = None, None
    if active:
        try:
            result = fn()
        except (StartupError, OSError, ValueError, RuntimeError) as e:
            error = str(e) if isinstance(e, StartupError) else first_line(e)
            rank = dist.get_rank() if dist.is_initialized() else 0
            if rank and not error.startswith("rank "):
                error = f"rank {rank}: {error}"
    error = first_error(error)
    if error:
        raise StartupError(error)
    return result


_COMM_MARKERS = (
    "gloo",
    "connection reset by peer",
    "connection closed by peer",
    "pair closure",
    "nccl",
    "broken pipe",
    "timed out waiting",
)


def comm_failure(e: BaseException) -> str | None:
    """The one-line reason for a failed collective (``e``), naming the phase it was
    waiting in; None when ``e`` is not a communication failure."""
    text = str(e).lower()
    if not (isinstance(e, dist.DistError) or any(m in text for m in _COMM_MARKERS)):
        return None
    if "timed out" in text or "timeout" in text:
        stalled = ranks_not_waiting(min(10.0, _TIMEOUT_MINUTES * 30.0))
        who = (
            f"rank{'s' if len(stalled) > 1 else ''} {', '.join(map(str, stalled))}, "
            f"which did not reach it"
            if stalled
            else "the other ranks"
        )
        return (
            f"timed out after {format_minutes(_TIMEOUT_MINUTES)} during {_PHASE} "
            f"waiting for {who}: a rank stalled or stopped (see its message above, if "
            f"any); --distributed-timeout-minutes sets the limit"
        )
    return (
        f"lost contact with another rank during {_PHASE}: it stopped without a message "
        f"(killed, out of memory, or crashed?): {_cause(first_line(e))}"
    )


_TIMED_OUT = "mp_offload/timed_out/"


def ranks_not_waiting(grace_s: float) -> list[int]:
    """After a collective timed out on this rank: the ranks that did not also time out
    within ``grace_s`` (each waiting rank marks itself in the rendezvous store), i.e. the
    ones the job waited for. gloo and NCCL do not name them. [] when the store cannot
    tell (a lone process, or the store's host is gone)."""
    if _STORE is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    world = dist.get_world_size()
    keys = [f"{_TIMED_OUT}{r}" for r in range(world)]
    try:
        _STORE.set(keys[dist.get_rank()], _PHASE)
        deadline = time.monotonic() + grace_s
        while True:  # the waiting ranks time out within moments of each other
            missing = [r for r in range(world) if not _STORE.check([keys[r]])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)
    except Exception:  # the store lives in rank 0's launcher or process: it may be gone
        return []


def _cause(text: str) -> str:
    """gloo's message without its source location and advice: "[.../pair.cc:537] Read
    error [10.0.0.2]:9111: Connection reset by peer. This is typically..." -> "Read
    error [10.0.0.2]:9111: Connection reset by peer"."""
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0]
