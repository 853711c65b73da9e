"""The collective save: every rank writes its own files, rank 0 commits the iteration.

Each (TP, DP) rank writes its optimizer slice (and DP rank 0 its TP shard of the
weights) into the save's temporary directory; the file sizes and checksums are
gathered, and global rank 0 writes ``common.pt`` and the manifest and commits
(``on_disk.commit``: crash-safe, the previous checkpoint stays loadable until the end).

Nothing non-finite is published: each rank checks the weights and fp32 master it is
about to write (``all_finite``: one inf-norm reduction per tensor) and sends the verdict
with its file list; if any rank found inf or NaN, the temporary directory is removed
and every rank raises ``NonFiniteStateError`` before the commit and the rotation, so the
last good checkpoint stays the latest. (A diverging step blows up the weights before
the loss shows it: the loss of a step is computed from the weights before it.)
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import torch
import torch.distributed as dist

from .. import parallel_state as ps
from ..optimizer.checkpoint_parts import KEYS, Streamed, slice_state
from ..runtime import faults
from . import on_disk as fmt
from .errors import CheckpointError
from .save_group import planned_bytes, save_group


class NonFiniteStateError(CheckpointError):
    """The state a save was about to publish holds inf or NaN; nothing was published."""


def all_finite(tensors) -> bool:
    """No inf or NaN in any of ``tensors``: the inf-norm (the largest |x|, a reduction
    with no temporary the size of the data) is finite exactly when every element is. One
    host sync per device, however many tensors."""
    norms = {}
    for t in tensors:
        if t.numel():
            norm = torch.linalg.vector_norm(t.detach(), float("inf"))
            norms.setdefault(norm.device, []).append(norm.float())
    return all(bool(torch.stack(n).isfinite().all()) for n in norms.values())


def _parts(value) -> list:
    """A saved optimizer slice as its tensors (one tensor, or its parts in order)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _rank_files(tmp: str, model, optimizer, tp_rank: int, dp_rank: int) -> tuple[dict, str]:
    """Write this rank's files: (their manifest entries, "" or what of them is not finite,
    in which case nothing more is written)."""
    files, where = {}, f"TP rank {tp_rank}, DP rank {dp_rank}"
    if dp_rank == 0:  # the DP replicas hold the same weights: one copy per TP rank
        if not all_finite(p for _, p in model.named_parameters()):
            return files, f"the weights ({where})"
        rel = fmt.model_file(tp_rank)
        # The device tensors themselves: torch.save copies them to the host one storage at
        # a time as it writes (a whole host copy of the shard, 2 B/param at 70B, would not
        # fit beside the offloaded state); every reader maps them to the CPU.
        files[rel] = fmt.write_file(
            {n: p.detach() for n, p in model.named_parameters()}, os.path.join(tmp, rel)
        )
    rel = fmt.optim_file(tp_rank, dp_rank)
    if optimizer.checkpoint_kind == "zero":
        shard = slice_state(optimizer, streamed=True)
        if not _write_streamed(shard, tmp, rel, files):
            return files, f"the fp32 master weights ({where})"
    else:  # torch-adamw: the (fp32) weights are the master, checked above
        shard = {"torch_adamw": optimizer.state_dict()}
    shard["rng"] = fmt.rng_state()
    files[rel] = fmt.write_file(shard, os.path.join(tmp, rel))
    return files, ""


def _write_streamed(shard: dict, tmp: str, rel: str, files: dict) -> bool:
    """Write the ``Streamed`` keys of a ZeRO ``shard`` as raw files beside ``rel`` (the
    master first) and name them in it; False, with the rest unwritten, as soon as the
    master is found to hold inf or NaN (checked as it is written, or in place)."""
    if not isinstance(shard["master"], Streamed) and not all_finite(_parts(shard["master"])):
        return False
    os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
    for key in KEYS:  # the master first
        value = shard[key]
        if isinstance(value, Streamed):
            raw = fmt.raw_file(rel, key)
            files[raw], ok = fmt.write_raw(value.chunks(), os.path.join(tmp, raw), key == "master")
            if not ok:
                return False
            shard[key] = {"raw_fp32": raw, "numel": value.numel}
    return True


def _latest(root: str) -> int | None:
    """The latest iteration under ``root``, or None (also when its pointer is unreadable:
    this runs on rank 0 alone, between collectives, so it must not raise)."""
    try:
        return fmt.read_latest(root)
    except (CheckpointError, OSError):
        return None


def _refuse_non_finite(root: str, iteration: int, gathered: list) -> None:
    """Collective outcome of the finiteness checks (``gathered``: every rank's (files,
    problem, latest)): if any rank found inf or NaN, rank 0 removes the temporary
    directory and every rank raises the same NonFiniteStateError."""
    problems = [p for _, p, _ in gathered if p]
    if not problems:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(fmt.tmp_dir(root, iteration), ignore_errors=True)
    latest = gathered[0][2]  # rank 0's view of the save directory: one message everywhere
    kept = (
        f"iteration {latest} stays the latest checkpoint in --save {root}"
        if latest is not None
        else f"--save {root} holds no earlier checkpoint"
    )
    more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
    raise NonFiniteStateError(
        f"the checkpoint of iteration {iteration} was not saved: {problems[0]}{more} "
        f"hold inf or NaN, the run diverged in its last steps; {kept} (lower --lr, "
        f"check the data, or use --bf16)"
    )


def save_checkpoint(
    root: str,
    iteration: int,
    consumed_samples: int,
    model,
    optimizer,
    args,
    keep: int | None = None,
    protect: int | None = None,
) -> str:
    """Collective: every rank calls it. Returns the final directory. ``keep``: the
    number of iterations kept; ``protect``: one more that rotation spares (``fmt.prune``)."""
    optimizer.flush()  # a delayed update applied, and the weights' uploads landed: read next
    tp, dp = ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size()
    tmp = fmt.tmp_dir(root, iteration)
    if dist.get_rank() == 0:
        fmt.start_save(root, iteration)
    # The ranks meet (the save is open) and agree on the save's wait before the slow part.
    group = save_group(planned_bytes(model, optimizer, ps.get_data_parallel_rank()))
    files, problem = _rank_files(
        tmp, model, optimizer, ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    )
    faults.checkpoint_point("after_rank_files", iteration)
    latest = _latest(root) if dist.get_rank() == 0 else None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (files, problem, latest), group=group)
    _refuse_non_finite(root, iteration, gathered)  # before the commit and the rotation
    final = fmt.iter_dir(root, iteration)
    if dist.get_rank() == 0:
        all_files = {k: v for f, _, _ in gathered for k, v in f.items()}
        run_args = {k: dataclasses.asdict(v) for k, v in vars(args).items()}
        tok_entries, tok_stored = fmt.copy_tokenizer(run_args.get("data", {}), tmp)
        all_files.update(tok_entries)
        common = {
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "args": run_args,
            "tokenizer_files": tok_stored,
        }
        all_files[fmt.COMMON] = fmt.write_file(common, os.path.join(tmp, fmt.COMMON))
        manifest = fmt.make_manifest(
            iteration=iteration,
            tp=tp,
            dp=dp,
            optimizer=optimizer.checkpoint_kind,
            model_config=dataclasses.asdict(args.model),
            params=fmt.param_info(model.named_parameters(), tp),
            files=all_files,
        )
        fmt.commit(root, iteration, manifest)
        if keep:
            fmt.prune(root, keep, iteration, protect)
    dist.barrier(group=group)
    return final
