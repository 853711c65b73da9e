"""Start-up checks of --save, so that a run never loses checkpoints it did not write.

Run before training (``prepare_save``, collective):

- the directory is writable (not a file, not read-only), found now rather than at the
  first save hours later;
- one job per directory: a lock file holding the holder's host and pid; a second job
  refuses, and a lock whose process is dead on this host is taken over;
- no silent overwrite: a run that did not resume from the newest checkpoint in --save
  (a misspelled --load, an older iteration, --finetune) would write over those
  iterations and move the latest pointer back, so it refuses unless
  --override-existing-checkpoints is given.

and around every save (``disk_full_guard``): a full disk, quota or file-size limit is
one line naming the directory and its free space, and the partial save is removed
(it would keep the disk full).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import time

import torch.distributed as dist

from . import on_disk as fmt
from .errors import CheckpointError, raise_agreed

_READ_TRIES = 5  # a lock just created may still be empty for an instant


def check_writable(save: str) -> None:
    """Refuse a --save that is a file or cannot be written (one probe file per process)."""
    if os.path.exists(save) and not os.path.isdir(save):
        raise CheckpointError(f"--save {save}: is a file, not a directory")
    probe = os.path.join(save, f".write_probe.{socket.gethostname()}.{os.getpid()}")
    try:
        os.makedirs(save, exist_ok=True)
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"--save {save}: not writable ({e.strerror or e})") from None


def _iterations_text(its: list[int]) -> str:
    shown = ", ".join(map(str, its[:3] + (["..."] if len(its) > 4 else []) + its[3:][-1:]))
    return f"iteration{'s' if len(its) > 1 else ''} {shown}"


def check_no_overwrite(
    save: str, load: str | None, *, finetune: bool = False, override: bool = False
) -> None:
    """Refuse to save into a directory holding checkpoints this run did not resume from.

    Resuming means: --load resolves to --save's newest iteration (the root itself or
    that ``iter_*`` directory) and the iteration count continues (no --finetune).
    """
    existing = fmt.list_iterations(save)
    if not existing or override:
        return
    newest = existing[-1]
    ckpt = fmt.find_checkpoint(load) if load else None
    if ckpt is not None and not os.path.exists(os.path.join(ckpt, fmt.MANIFEST)):
        raise CheckpointError(
            f"--load {load}: {os.path.join(ckpt, fmt.MANIFEST)} is missing (the latest "
            f"pointer or --load names a checkpoint that was deleted or never finished); "
            f"{save} holds {_iterations_text(existing)}: give --load "
            f"{fmt.iter_dir(save, newest)} to resume the newest"
        )
    if ckpt is None:
        why = f"--load {load} holds no checkpoint" if load else "no --load"
    else:
        same_root = os.path.realpath(os.path.dirname(os.path.normpath(ckpt))) == os.path.realpath(
            save
        )
        it = fmt.iteration_of(ckpt)
        if same_root and it == newest and not finetune:
            return
        why = (
            "--finetune restarts at iteration 0"
            if finetune and same_root
            else f"--load {load} resumes iteration {it}, not the newest"
            if same_root
            else f"--load {load} is another directory"
        )
    raise CheckpointError(
        f"--save {save} already holds checkpoints ({_iterations_text(existing)}) this run "
        f"would overwrite or hide ({why}); fix --load, choose another --save, or pass "
        f"--override-existing-checkpoints"
    )


# -------------------------------------------------------------------------- lock
def _process_state(pid: int) -> tuple[str, str] | None:
    """(state letter, start time) from /proc, or None where there is no /proc entry."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], fields[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    state = _process_state(pid)
    if state is None:
        return True
    # A zombie is dead; another start time means the pid was reused.
    return state[0] != "Z" and (started is None or state[1] == started)


class SaveLock:
    """The lock file in a save directory: ``{"host", "pid", "started"}`` of its holder."""

    def __init__(self, save: str):
        self.save, self.path = save, os.path.join(save, fmt.LOCK)
        state = _process_state(os.getpid())
        self.record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": state[1] if state else None,
        }
        self.held = False

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.record, f)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            with contextlib.suppress(OSError):  # an empty lock would block the next run
                os.remove(self.path)
            raise
        return True

    def _holder(self, path: str | None = None) -> dict | None:
        for _ in range(_READ_TRIES):
            try:
                with open(path or self.path) as f:
                    return json.load(f)
            except FileNotFoundError:
                return None
            except (json.JSONDecodeError, UnicodeDecodeError):
                time.sleep(0.1)
        with contextlib.suppress(OSError):
            if os.path.getsize(path or self.path) == 0:
                return {}  # still empty: its job died between creating and writing it
        raise CheckpointError(
            f"{path or self.path}: unreadable lock file; remove it if no "
            f"job is saving to --save {self.save}"
        )

    def _stale(self, holder: dict) -> bool:
        if not holder:
            return True
        return holder.get("host") == self.record["host"] and not _alive(
            int(holder.get("pid", 0)), holder.get("started")
        )

    def _take_over(self, holder: dict) -> None:
        """Move the stale lock aside; if a live job's lock replaced it meanwhile, put
        that one back (the next attempt then refuses)."""
        aside = f"{self.path}.stale.{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if self._holder(aside) != holder:
            os.rename(aside, self.path)
            return
        os.remove(aside)

    def acquire(self, log=None) -> None:
        """Take the lock; one whose holder is gone (an empty file, or a pid not alive on
        this host) is taken over, with a line saying so through ``log``."""
        for _ in range(3):
            if self._create():
                self.held = True
                return
            holder = self._holder()
            if holder is None:
                continue  # released meanwhile
            if not self._stale(holder):
                raise CheckpointError(
                    f"--save {self.save} is in use by another job (host {holder.get('host')}, "
                    f"pid {holder.get('pid')}, lock {self.path}); remove the lock only if "
                    f"that job is gone"
                )
            self._take_over(holder)
            if log:
                whose = (
                    f"of pid {holder.get('pid')} (not alive on {holder.get('host')})"
                    if holder
                    else "left empty by a job that died while taking it"
                )
                log(f"took over the stale lock {self.path} {whose}")
        raise CheckpointError(f"{self.path}: could not take the lock (contended)")

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        if self.held:
            self.held = False
            try:
                if self._holder() == self.record:
                    os.remove(self.path)
            except (OSError, CheckpointError):
                pass  # gone already, or not ours: nothing to release


def prepare_save(ckpt_cfg, log=None) -> SaveLock | None:
    """Collective, before training: check --save (every rank), lock it (global rank 0),
    refuse an overwrite. Any rank's failure raises the same error on every rank, after
    the lock is released again. Returns the lock to ``release`` at exit."""
    c = ckpt_cfg
    if not c.save:
        return None
    error, lock = None, None
    try:
        check_writable(c.save)
        if dist.get_rank() == 0:
            lock = SaveLock(c.save)
            lock.acquire(log)
        check_no_overwrite(
            c.save, c.load, finetune=c.finetune, override=c.override_existing_checkpoints
        )
    except CheckpointError as e:
        error = str(e)
    except OSError as e:
        error = f"--save {c.save}: {e}"
    try:
        raise_agreed(error)
    except CheckpointError:
        if lock is not None:
            lock.release()
        raise
    existing = fmt.list_iterations(c.save)
    if log and existing and c.override_existing_checkpoints:
        log(
            f"--override-existing-checkpoints: {c.save} holds {_iterations_text(existing)}; "
            f"saves from this run may overwrite them"
        )
    return lock


# ------------------------------------------------------------------- a full disk
_DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _disk_full(e: BaseException | None) -> OSError | None:
    """The full-disk OSError behind ``e`` (torch.save raises its own RuntimeError while
    handling the OSError of the write), or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            return e
        e = e.__cause__ or e.__context__
    return None


def _free_text(root: str) -> str:
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return "free space unknown"
    return f"{free / 2**20:,.1f} MiB free"


@contextlib.contextmanager
def disk_full_guard(root: str, iteration: int):
    """Around a save: a full disk (ENOSPC, a quota, a file-size limit) becomes one
    CheckpointError naming ``root`` and its free space, and the partial save is removed."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        full = _disk_full(e)
        if full is None:
            raise
        tmp = fmt.tmp_dir(root, iteration)
        shutil.rmtree(tmp, ignore_errors=True)
        limit = ", the file-size limit (ulimit -f)" if full.errno == errno.EFBIG else ""
        raise CheckpointError(
            f"--save {root}: the checkpoint of iteration {iteration} could not be written "
            f"({full.strerror or full}{limit}; {_free_text(root)}); its partial directory "
            f"{tmp} was removed; free space (or lower --keep-checkpoints) and resume"
        ) from None
