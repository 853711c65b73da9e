"""Checkpoints: exact resume, resharding to other TP/DP sizes, crash-safe writes.

Layout (Megatron's spirit)::

    <save>/iter_0000100/manifest.json          format, sizes, model config, params, checksums
    <save>/iter_0000100/common.pt              iteration, consumed samples, arguments
    <save>/iter_0000100/mp_rank_00/model.pt    TP shard of the weights (compute dtype)
    <save>/iter_0000100/mp_rank_00/optim_dp000.pt  this (TP, DP) rank's fp32 master/m/v
                                                   slice, its layout, step, scaler, RNG
    <save>/latest_checkpointed_iteration.txt

A save goes to a hidden temporary directory; every file is fsynced; the manifest is
written last; then the directory is renamed into place and only then does the
latest pointer move. A save killed at any point leaves the previous one loadable.
Loading re-partitions the optimizer slices one parameter at a time (reader 3 and 4
of the metadata contract), so no rank ever holds the whole optimizer state.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil

import torch
import torch.distributed as dist

from . import faults
from . import parallel_state as ps
from .optimizer.layout import layout_from_description
from .tensor_parallel.random import get_rng_tracker
from .tensor_parallel.utils import merge_partitions, split_for_rank

FORMAT_VERSION = 1
LATEST = "latest_checkpointed_iteration.txt"
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "vocab_size", "max_position_embeddings")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the mismatch."""


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _write(obj, path: str, text: bool = False) -> dict:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w" if text else "wb") as f:
        if text:
            f.write(obj)
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return dict(bytes=os.path.getsize(path), sha256=_sha256(path))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict:
    state = dict(cpu=torch.get_rng_state(), tracker=get_rng_tracker().get_states())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _param_info(model, tp: int) -> dict:
    info = {}
    for name, p in model.named_parameters():
        shape = list(p.shape)
        if p.tensor_model_parallel:
            shape[p.partition_dim] *= tp
        info[name] = dict(shape=shape, tensor_model_parallel=bool(p.tensor_model_parallel),
                          partition_dim=int(p.partition_dim), stride=int(p.partition_stride))
    return info


def _optim_file(tp_rank: int, dp_rank: int) -> str:
    return os.path.join(f"mp_rank_{tp_rank:02d}", f"optim_dp{dp_rank:03d}.pt")


def save_checkpoint(root: str, iteration: int, consumed_samples: int, model, optimizer,
                    args, keep: int | None = None) -> str:
    """Collective: every rank calls it. Returns the final directory."""
    rank = dist.get_rank()
    tp, dp = ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size()
    tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    final = iter_dir(root, iteration)
    tmp = os.path.join(root, f".tmp_iter_{iteration:07d}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for d in os.listdir(root):  # leftovers of saves that were killed
            if d.startswith(".tmp_iter_"):
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    files = {}
    if dp_rank == 0:
        weights = {n: p.detach().cpu() for n, p in model.named_parameters()}
        rel = os.path.join(f"mp_rank_{tp_rank:02d}", "model.pt")
        files[rel] = _write(weights, os.path.join(tmp, rel))
    kind = optimizer.checkpoint_kind
    shard = optimizer.state_dict() if kind == "zero" else dict(torch_adamw=optimizer.state_dict())
    shard["rng"] = _rng_state()
    rel = _optim_file(tp_rank, dp_rank)
    files[rel] = _write(shard, os.path.join(tmp, rel))
    faults.checkpoint_point("after_rank_files", iteration)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, files)
    if rank == 0:
        all_files = {k: v for f in gathered for k, v in f.items()}
        common = dict(iteration=iteration, consumed_samples=consumed_samples,
                      args={k: dataclasses.asdict(v) for k, v in vars(args).items()})
        all_files["common.pt"] = _write(common, os.path.join(tmp, "common.pt"))
        manifest = dict(format_version=FORMAT_VERSION, iteration=iteration,
                        tensor_model_parallel_size=tp, data_parallel_size=dp,
                        optimizer=kind,
                        model_config=dataclasses.asdict(args.model),
                        params=_param_info(model, tp), files=all_files)
        faults.checkpoint_point("before_manifest", iteration)
        _write(json.dumps(manifest, indent=1), os.path.join(tmp, "manifest.json"), text=True)
        _fsync_dir(tmp)
        faults.checkpoint_point("before_rename", iteration)
        if os.path.exists(final):  # re-saving an iteration: the old copy goes only after
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write(str(iteration), os.path.join(root, LATEST + ".tmp"), text=True)
        os.replace(os.path.join(root, LATEST + ".tmp"), os.path.join(root, LATEST))
        _fsync_dir(root)
        shutil.rmtree(final + ".old", ignore_errors=True)
        if keep:
            _prune(root, keep, iteration)
    dist.barrier()
    return final


def _prune(root: str, keep: int, newest: int) -> None:
    its = sorted(int(d[5:]) for d in os.listdir(root)
                 if d.startswith("iter_") and d[5:].isdigit())
    for it in its[:-keep]:
        if it != newest:
            shutil.rmtree(iter_dir(root, it), ignore_errors=True)


def read_latest(root: str) -> int | None:
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text[:40]!r}")
    return int(text)


# ------------------------------------------------------------------ loading
class _Reader:
    """Opens checkpoint files lazily (mmap) after checking size and checksum once."""

    def __init__(self, ckpt: str, manifest: dict):
        self.ckpt, self.files, self.cache = ckpt, manifest["files"], {}
        self.layouts = {}

    def pieces(self, tp_rank: int, dp_rank: int) -> dict:
        """name -> [(offset in param, offset in slice, length)] of a saved (TP, DP) slice."""
        key = (tp_rank, dp_rank)
        if key not in self.layouts:
            layout = layout_from_description(self(_optim_file(*key))["layout"], dp_rank)
            by_name = {}
            for slot, p_off, h_off, n in layout.owned_pieces():
                by_name.setdefault(slot.name, []).append((p_off, h_off, n))
            self.layouts[key] = by_name
        return self.layouts[key]

    def __call__(self, rel: str) -> dict:
        if rel not in self.cache:
            path = os.path.join(self.ckpt, rel)
            meta = self.files.get(rel)
            if meta is None or not os.path.exists(path):
                raise CheckpointError(f"{path}: missing (the checkpoint lists "
                                      f"{len(self.files)} files)")
            size = os.path.getsize(path)
            if size != meta["bytes"]:
                raise CheckpointError(f"{path}: truncated or altered ({size} bytes, manifest "
                                      f"says {meta['bytes']})")
            if _sha256(path) != meta["sha256"]:
                raise CheckpointError(f"{path}: checksum mismatch (corrupted)")
            self.cache[rel] = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        return self.cache[rel]


def _check_manifest(ckpt: str, args) -> dict:
    path = os.path.join(ckpt, "manifest.json")
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing (incomplete save?)")
    try:
        manifest = json.load(open(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {manifest.get('format_version')}, "
                              f"this code reads {FORMAT_VERSION}")
    saved = manifest["model_config"]
    for f in SHAPE_FIELDS:
        here = getattr(args.model, f)
        if saved.get(f) != here:
            flag = "--" + f.replace("_", "-")
            raise CheckpointError(f"{path}: {flag} is {here} here but {saved.get(f)} in the "
                                  f"checkpoint")
    return manifest


def _old_local(read, manifest, name: str, tp_rank: int, key: str, shape) -> torch.Tensor:
    """One parameter's TP-local fp32 tensor at the checkpoint's layout, from its DP slices."""
    out = torch.zeros(int(torch.Size(shape).numel()), dtype=torch.float32)
    for b in range(manifest["data_parallel_size"]):
        src = read(_optim_file(tp_rank, b))[key]
        for p_off, h_off, n in read.pieces(tp_rank, b).get(name, ()):
            out[p_off:p_off + n] = src[h_off:h_off + n]
    return out.view(shape)


def _resharded(read, manifest, name, p, key: str) -> torch.Tensor:
    """``name``'s tensor for this rank's TP slice, re-split from the saved TP layout."""
    info, old_tp = manifest["params"][name], manifest["tensor_model_parallel_size"]
    if not info["tensor_model_parallel"]:
        return _old_local(read, manifest, name, 0, key, info["shape"])
    dim, stride = info["partition_dim"], info["stride"]
    local = list(info["shape"])
    local[dim] //= old_tp
    full = merge_partitions([_old_local(read, manifest, name, a, key, local)
                             for a in range(old_tp)], dim, stride)
    want = list(p.shape)
    want[dim] *= ps.get_tensor_model_parallel_world_size()
    if full.shape[dim] != want[dim]:  # the vocabulary is padded differently for this TP
        fixed = torch.zeros(want, dtype=full.dtype)
        n = min(full.shape[dim], want[dim])
        fixed.narrow(dim, 0, n).copy_(full.narrow(dim, 0, n))
        full = fixed
    return split_for_rank(full, dim, ps.get_tensor_model_parallel_world_size(),
                          ps.get_tensor_model_parallel_rank(), stride)


def _read_zero(read, manifest, optimizer, load_optim: bool):
    """Phase 1 (no collectives): this rank's new slice tensors, its saved shard or None."""
    tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    same = (manifest["tensor_model_parallel_size"] == ps.get_tensor_model_parallel_world_size()
            and manifest["data_parallel_size"] == ps.get_data_parallel_world_size())
    own = read(_optim_file(tp_rank, dp_rank)) if same else None
    keys = ("master", "exp_avg", "exp_avg_sq") if load_optim else ("master",)
    if own is not None and own["layout"] == optimizer.layout.describe():
        return {k: own[k] for k in keys}, own, own  # exact resume: the slice as saved
    tensors = {k: torch.zeros(optimizer.layout.host_numel) for k in keys}
    # Re-partition: each parameter owns at most one piece of this slice; build it, copy it.
    for slot, p_off, h_off, n in optimizer.layout.owned_pieces():
        for k in keys:
            full = _resharded(read, manifest, slot.name, slot.param, k).reshape(-1)
            tensors[k][h_off:h_off + n] = full[p_off:p_off + n]
    return tensors, read(_optim_file(0, 0)), None


def _install_zero(optimizer, tensors, shard, load_optim: bool) -> None:
    """Phase 2 (collective: republishes the device params)."""
    if load_optim:
        optimizer.load_state_dict(dict(tensors, step=shard["step"], scaler=shard["scaler"]))
    else:
        optimizer.load_state_dict(dict(master=tensors["master"]))


def load_checkpoint(root: str, model, optimizer, args, *, load_optim: bool = True,
                    load_rng: bool = True) -> tuple[int, int] | None:
    """Collective. Returns (iteration, consumed_samples), or None when nothing is saved.

    Any rank's failure is raised on every rank (with that rank's message), never a hang:
    everything that can fail runs before the one collective that shares the errors.
    """
    error, result, own, staged = None, None, None, None
    try:
        iteration = read_latest(root)
        if iteration is not None:
            ckpt = iter_dir(root, iteration)
            manifest = _check_manifest(ckpt, args)
            read = _Reader(ckpt, manifest)
            common = read("common.pt")
            kind = optimizer.checkpoint_kind
            if manifest["optimizer"] != kind:
                raise CheckpointError(f"{ckpt}: saved with optimizer {manifest['optimizer']}, "
                                      f"this run uses --optimizer {args.optim.optimizer}")
            if kind == "zero":
                tensors, shard, own = _read_zero(read, manifest, optimizer, load_optim)
                staged = (tensors, shard)
            else:
                raise CheckpointError(f"{ckpt}: saved with optimizer {manifest['optimizer']}, "
                                      f"this run uses --optimizer {args.optim.optimizer}")
            result = (common["iteration"], common["consumed_samples"])
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - an unreadable file must not hang the others
        error = f"checkpoint in {root}: {type(e).__name__}: {e}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)
    if staged is not None:
        _install_zero(optimizer, *staged, load_optim)
    if own is not None and load_rng:
        torch.set_rng_state(own["rng"]["cpu"])
        get_rng_tracker().set_states(own["rng"]["tracker"])
        if "cuda" in own["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(own["rng"]["cuda"])
    return result


def _load_torch_adamw(read, manifest, model, optimizer, load_optim: bool):
    if (manifest["tensor_model_parallel_size"] != ps.get_tensor_model_parallel_world_size()
            or manifest["data_parallel_size"] != ps.get_data_parallel_world_size()):
        raise CheckpointError("torch-adamw checkpoints reload only at the same TP/DP sizes; "
                              "use --optimizer adam to reshard")
    tp_rank = ps.get_tensor_model_parallel_rank()
    weights = read(os.path.join(f"mp_rank_{tp_rank:02d}", "model.pt"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    own = read(_optim_file(tp_rank, ps.get_data_parallel_rank()))
    if load_optim:
        optimizer.load_state_dict(own["torch_adamw"])
    return own

