"""The collective save: every rank writes its own files, rank 0 commits the iteration.

Each (TP, DP) rank writes its optimizer slice (and DP rank 0 its TP shard of the
weights) into the save's temporary directory; the file sizes and checksums are
gathered, and global rank 0 writes ``common.pt`` and the manifest and commits
(``on_disk.commit``: crash-safe, the previous checkpoint stays loadable until the end).
"""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

from .. import faults
from .. import parallel_state as ps
from . import on_disk as fmt
from .save_group import planned_bytes, save_group


def _rank_files(tmp: str, model, optimizer, tp_rank: int, dp_rank: int) -> dict:
    """Write this rank's files; returns their manifest entries."""
    files = {}
    if dp_rank == 0:  # the DP replicas hold the same weights: one copy per TP rank
        rel = fmt.model_file(tp_rank)
        # A temporary: the weights' host copies (on CUDA) are freed before the optimizer
        # file is written, so a save's peak is the larger of the two, not their sum.
        files[rel] = fmt.write_file(
            {n: p.detach().cpu() for n, p in model.named_parameters()}, os.path.join(tmp, rel)
        )
    if optimizer.checkpoint_kind == "zero":
        shard = optimizer.state_dict()
    else:
        shard = {"torch_adamw": optimizer.state_dict()}
    shard["rng"] = fmt.rng_state()
    rel = fmt.optim_file(tp_rank, dp_rank)
    files[rel] = fmt.write_file(shard, os.path.join(tmp, rel))
    return files


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
    tp, dp = ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size()
    tmp = fmt.tmp_dir(root, iteration)
    if dist.get_rank() == 0:
        fmt.start_save(root, iteration)
    # The ranks meet (the save is open) and agree on the save's wait before the slow part.
    group = save_group(planned_bytes(model, optimizer, ps.get_data_parallel_rank()))
    files = _rank_files(
        tmp, model, optimizer, ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    )
    faults.checkpoint_point("after_rank_files", iteration)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, files, group=group)
    final = fmt.iter_dir(root, iteration)
    if dist.get_rank() == 0:
        all_files = {k: v for f in gathered for k, v in f.items()}
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
