"""The memory preflight: before anything is allocated, the planner's figures for this run
(what ``pretrain_gpt.py --dry-run`` prints) against what this machine has free.

Host: each rank of this node (LOCAL_WORLD_SIZE of them) needs the planner's host sum,
and on a CPU "device" its device sum too (both live in the same RAM), less the planner's
estimate of the process itself, which is already running. Available: MemAvailable, or
the room the cgroup's memory limit leaves when that is less. Device (CUDA): the
planner's device sum against the free memory ``torch.cuda.mem_get_info`` reports.

A run that does not fit ends before it allocates, on every rank, with one line naming
both numbers and the flags that would make it fit (the planner asked again with them:
offload fraction, parameter remainders, 8-bit moments, more nodes), exit 2.
``--skip-memory-check`` starts it anyway. The planner is called in one place,
``rank_needs``.
"""

from __future__ import annotations

import dataclasses
import os

import torch

GiB = 1 << 30
MEMINFO_ENV = "MP_OFFLOAD_MEMINFO"  # a file in /proc/meminfo's format read instead (tests)
MAX_NODES = 4096  # "more nodes" is searched up to this many


@dataclasses.dataclass
class Need:
    """Bytes one rank will still allocate, by category."""

    host: dict
    device: dict

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def device_total(self) -> int:
        return sum(self.device.values())


def rank_needs(args, world: int, cuda: bool) -> Need:
    """The planner's per-rank sums for ``args`` at ``world`` ranks, as --dry-run plans
    them (the largest rank kind), less the process itself; on a CPU device the device's
    categories are host memory too."""
    from .planner.arguments import run_from_args
    from .planner.memory import Hardware, plan_job

    plan = plan_job(
        run_from_args(args, world, cuda=cuda),
        Hardware(device_reserved_gb=1.0 if cuda else 0.0),
        source="meta",
    )
    ranks = [(dict(r.host), dict(r.device)) for r in plan.ranks]
    for host, device in ranks:
        host.pop("process", None)  # already running: counted in what is in use
        if not cuda:
            host.update({f"{k} (CPU device)": v for k, v in device.items()})
            device.clear()
    host, device = max(ranks, key=lambda hd: (sum(hd[0].values()), sum(hd[1].values())))
    return Need({k: v for k, v in host.items() if v}, {k: v for k, v in device.items() if v})


# ------------------------------------------------------------------ what is free
def _meminfo_available() -> int | None:
    try:
        with open(os.environ.get(MEMINFO_ENV, "/proc/meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_number(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


def _stat_value(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_dirs(root: str, proc_cgroup: str):
    """(directory, (limit, usage, inactive-cache key)) of this process's memory cgroup,
    v1 or v2; each at its path, then at ``root`` itself (a container sees its own)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: one hierarchy
            files = ("memory.max", "memory.current", "inactive_file")
            bases = (f"{root}{path}", root)
        elif "memory" in controllers.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            bases = (f"{root}/memory{path}", f"{root}/memory")
        else:
            continue
        for base in bases:
            if os.path.exists(os.path.join(base, files[0])):
                yield base, files
                break


def cgroup_room(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"):
    """Bytes the memory limit of this process's cgroup leaves: the limit less what is in
    use but not reclaimable page cache; None without a limit."""
    for base, files in _cgroup_dirs(root, proc_cgroup):
        limit, usage = (_read_number(os.path.join(base, f)) for f in files[:2])
        if limit is None or usage is None or limit >= 1 << 60:  # "max" or v1's huge value
            continue
        cache = _stat_value(os.path.join(base, "memory.stat"), files[2])
        return max(limit - max(usage - cache, 0), 0)
    return None


def host_available() -> tuple[int | None, str]:
    """(bytes this machine can still give, where the figure comes from)."""
    free, source = _meminfo_available(), "MemAvailable"
    room = cgroup_room()
    if room is not None and (free is None or room < free):
        free, source = room, "the cgroup's memory limit less its usage"
    return free, source


def device_available(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


# ------------------------------------------------------------------ what would fit
def _optim(args, **changes):
    return dataclasses.replace(args, optim=dataclasses.replace(args.optim, **changes))


def _candidates(args, cuda: bool) -> list[tuple[str, object]]:
    """(flags, the args with them) that lower the memory a rank needs, in the order
    they are offered: the fewest changes first."""
    o, out = args.optim, []
    if cuda and o.optimizer == "adam" and not o.cpu_offload:
        out.append(("--cpu-offload", _optim(args, cpu_offload=True)))
    if cuda and o.cpu_offload:
        now = 1.0 if o.optimizer_offload_fraction is None else o.optimizer_offload_fraction
        for f in (1.0, 0.75, 0.5, 0.25, 0.0):  # the largest host share that fits first
            if f != now:
                flag = f"--optimizer-offload-fraction {f:g}"
                out.append((flag, _optim(args, optimizer_offload_fraction=f)))
    remainders = ("--store-param-remainders", dict(store_param_remainders=True))
    eight_bit = (
        "--exp-avg-dtype 8bit --exp-avg-sq-dtype 8bit",
        dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit"),
    )
    both = (f"{remainders[0]} {eight_bit[0]}", {**remainders[1], **eight_bit[1]})
    for flags, changes in (remainders, eight_bit, both):
        out.append((flags, _optim(args, **changes)))
    if cuda and not args.model.recompute_activations:
        model = dataclasses.replace(args.model, recompute_activations=True)
        out.append(("--recompute-activations", dataclasses.replace(args, model=model)))
    return out


def _nodes_needed(args, world: int, cuda: bool, fits) -> int | None:
    """The fewest nodes like this one (``world`` ranks each) the run fits on, or None
    up to MAX_NODES: doubling, then halving the gap."""
    high = 2
    while not fits(rank_needs(args, world * high, cuda)):
        high *= 2
        if high > MAX_NODES:
            return None
    low = high // 2  # does not fit
    while high - low > 1:
        mid = (low + high) // 2
        if fits(rank_needs(args, world * mid, cuda)):
            high = mid
        else:
            low = mid
    return high


def _fix(args, world: int, local: int, cuda: bool, fits) -> str:
    """The flags that would make the run fit, as a phrase."""
    from .config import config_problems

    for flags, cand in _candidates(args, cuda):
        if cand == args or config_problems(cand, world):
            continue  # set already, or not a legal combination with the run's flags
        if fits(rank_needs(cand, world, cuda)):
            return f"it would fit with {flags}"
    nodes = _nodes_needed(args, world, cuda, fits)
    if nodes is None:
        return (
            f"it would not fit on {MAX_NODES} such nodes either: choose a smaller model "
            f"or a larger --tensor-model-parallel-size"
        )
    savers = "--store-param-remainders or 8-bit moments"
    if cuda:
        savers = f"--optimizer-offload-fraction, {savers}"
    return (
        f"{savers} would not be enough; it would fit on {nodes} such nodes "
        f"({nodes * local} ranks: torchrun --nnodes {nodes})"
    )


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


def _largest(parts: dict) -> str:
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{k} {_gib(v)}" for k, v in top)


def memory_problem(args, world: int, local: int, device: torch.device) -> str | None:
    """The one-line reason this run does not fit this machine, or None."""
    cuda = device.type == "cuda"
    device_free = device_available(device)  # first: it creates the CUDA context
    host_free, source = host_available()
    need = rank_needs(args, world, cuda)

    def fits(n: Need) -> bool:
        host_ok = host_free is None or local * n.host_total <= host_free
        return host_ok and (device_free is None or n.device_total <= device_free)

    if fits(need):
        return None
    short = []
    if host_free is not None and local * need.host_total > host_free:
        ranks = f"{local} ranks need" if local > 1 else "1 rank needs"
        short.append(
            f"this node's {ranks} {_gib(local * need.host_total)} of host memory ({local} x "
            f"{_gib(need.host_total)}, most of it {_largest(need.host)}: the planner's "
            f"figures, as --dry-run prints them) but {_gib(host_free)} is available ({source})"
        )
    if device_free is not None and need.device_total > device_free:
        short.append(
            f"each rank needs {_gib(need.device_total)} on its GPU (most of it "
            f"{_largest(need.device)}) but {_gib(device_free)} of {device} is free"
        )
    return (
        f"not enough memory: {'; and '.join(short)}; {_fix(args, world, local, cuda, fits)} "
        f"(or --skip-memory-check to start anyway)"
    )


def check_memory(args, device: torch.device, tokenizer=None) -> None:
    """Collective, before anything is allocated: every rank stops with the first rank's
    reason (exit 2) when the run does not fit (unless --skip-memory-check). ``tokenizer``:
    the run's, whose vocabulary the model will have (else --vocab-size)."""
    from .runtime.distributed import fail, first_error
    from .runtime.logger import log

    if args.train.skip_memory_check:
        log.info("memory check skipped (--skip-memory-check)")
        return
    if tokenizer is not None:
        model = dataclasses.replace(args.model, vocab_size=tokenizer.vocab_size)
        args = dataclasses.replace(args, model=model)
    world = torch.distributed.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        problem = memory_problem(args, world, local, device)
    except Exception as e:  # noqa: BLE001 - a preflight that cannot tell must not stop a run
        problem = None
        log.info(f"memory check skipped: the plan failed ({type(e).__name__}: {e})")
    problem = first_error(problem)
    if problem:
        fail(problem)
