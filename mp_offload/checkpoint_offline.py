"""Offline access to checkpoints, for tools (convert, export, generate).

Everything here runs without process groups: a tool reads any checkpoint in one process
(or on every rank of a generation job), one parameter at a time, and can write a new one.
The on-disk format and its checks live in ``checkpointing``; this module only reuses them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch

from . import parallel_state as ps
from .checkpointing import (
    FORMAT_VERSION,
    LATEST,
    SHAPE_FIELDS,
    CheckpointError,
    _check_manifest,
    _fsync_dir,
    _old_local,
    _optim_file,
    _Reader,
    _rng_state,
    _write,
    iter_dir,
    read_latest,
)
from .tensor_parallel.utils import merge_partitions, split_for_rank


def resolve_checkpoint(path: str, iteration: int | None = None) -> str:
    """The iteration directory meant by ``path``: a save root (its latest checkpoint, or
    ``iteration``) or an ``iter_XXXXXXX`` directory itself."""
    if iteration is None and os.path.exists(os.path.join(path, "manifest.json")):
        return path
    if iteration is None:
        iteration = read_latest(path)
        if iteration is None:
            raise CheckpointError(f"{path}: no {LATEST} and no manifest.json (not a checkpoint)")
    ckpt = iter_dir(path, iteration)
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"{ckpt}: missing (no checkpoint at iteration {iteration})")
    return ckpt


def read_manifest(ckpt: str) -> dict:
    """The manifest of an iteration directory, with the loader's checks (shape fields are
    compared with themselves: there is no run to disagree with)."""
    saved = {}
    try:
        with open(os.path.join(ckpt, "manifest.json")) as f:
            saved = json.load(f).get("model_config", {})
    except Exception:  # noqa: BLE001 - _check_manifest names the problem
        pass
    from types import SimpleNamespace
    same = SimpleNamespace(**{f: saved.get(f) for f in SHAPE_FIELDS})
    return _check_manifest(ckpt, SimpleNamespace(model=same))


def config_from_manifest(manifest: dict):
    from .model.gpt import GPTConfig  # deferred: the model is not needed to save/load
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in manifest["model_config"].items() if k in known})


class FullTensors:
    """Full (TP-merged) fp32 tensors of one checkpoint, built one parameter at a time.

    ``get(name, key)``: key "master" (the weights), "exp_avg" or "exp_avg_sq" (Adam
    moments). Tensors keep the saved vocabulary padding (see ``fit_padding``). Reads
    zero (fp32 master slices) and torch-adamw (fp32 model.pt + torch state) checkpoints.
    """

    def __init__(self, ckpt: str):
        self.ckpt = ckpt
        self.manifest = read_manifest(ckpt)
        self.read = _Reader(ckpt, self.manifest)
        self.config = config_from_manifest(self.manifest)
        self.names = list(self.manifest["params"])
        self.tp = self.manifest["tensor_model_parallel_size"]
        self.kind = self.manifest["optimizer"]
        if self.kind not in ("zero", "torch-adamw"):
            raise CheckpointError(f"{ckpt}: unknown optimizer {self.kind!r}")
        # torch.optim.AdamW numbers its params by group: matrices first, then 1-D ones
        # (optimizer/torch_adamw.py: param_groups), each in model order.
        ndim = {n: len(i["shape"]) for n, i in self.manifest["params"].items()}
        order = [n for n in self.names if ndim[n] > 1] + [n for n in self.names if ndim[n] <= 1]
        self._adamw_index = {n: i for i, n in enumerate(order)}

    def common(self) -> dict:
        return self.read("common.pt")

    def shard0(self) -> dict:
        """TP rank 0 / DP rank 0's optimizer file: step, scaler, RNG (same on every rank)."""
        return self.read(_optim_file(0, 0))

    def _local(self, name: str, tp_rank: int, key: str, shape) -> torch.Tensor:
        if self.kind == "zero":
            return _old_local(self.read, self.manifest, name, tp_rank, key, shape)
        if key == "master":
            weights = self.read(os.path.join(f"mp_rank_{tp_rank:02d}", "model.pt"))
            return weights[name].float()
        state = self.read(_optim_file(tp_rank, 0))["torch_adamw"]["state"]
        entry = state.get(self._adamw_index[name])
        if entry is None:  # never stepped: zero moments
            return torch.zeros(shape, dtype=torch.float32)
        return entry[key].float().reshape(shape)

    def get(self, name: str, key: str = "master") -> torch.Tensor:
        info = self.manifest["params"][name]
        if not info["tensor_model_parallel"]:
            return self._local(name, 0, key, info["shape"])
        dim, stride = info["partition_dim"], info["stride"]
        local = list(info["shape"])
        local[dim] //= self.tp
        return merge_partitions([self._local(name, a, key, local) for a in range(self.tp)],
                                dim, stride)


def fit_padding(full: torch.Tensor, shape, dim: int) -> torch.Tensor:
    """Cut or zero-extend ``full`` along ``dim`` to ``shape`` (vocabulary padding differs
    between TP sizes; the padded rows are zero and never used)."""
    shape = list(shape)
    if list(full.shape) == shape:
        return full
    out = torch.zeros(shape, dtype=full.dtype)
    n = min(full.shape[dim], shape[dim])
    out.narrow(dim, 0, n).copy_(full.narrow(dim, 0, n))
    return out


def load_full_fp32_weights(ckpt_dir: str, iteration: int | None = None):
    """(GPTConfig, {name: full fp32 tensor}) of a checkpoint, saved padding kept."""
    full = FullTensors(resolve_checkpoint(ckpt_dir, iteration))
    return full.config, {n: full.get(n) for n in full.names}


def load_weights_resharded(ckpt: str, model) -> None:
    """Copy a checkpoint's weights into ``model``'s TP slice (any saved TP size).

    Needs no optimizer and no collective: each rank merges the full tensor of one
    parameter, re-pads the vocabulary for its TP size and keeps its own slice.
    """
    full = FullTensors(ckpt)
    tp, rank = model.tp_group.size, model.tp_group.rank
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in full.manifest["params"]:
                raise CheckpointError(f"{ckpt}: has no parameter {name}")
            t = full.get(name)
            if p.tensor_model_parallel:
                want = list(p.shape)
                want[p.partition_dim] *= tp
                t = split_for_rank(fit_padding(t, want, p.partition_dim), p.partition_dim, tp,
                                   rank, p.partition_stride)
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"{ckpt}: {name} has shape {tuple(t.shape)}, the model "
                                      f"wants {tuple(p.shape)}")
            p.copy_(t)


def write_checkpoint(root: str, iteration: int, consumed_samples: int, cfg, tp: int, tensor,
                     *, dtype=torch.float32, optimizer: str = "zero", step: int = 0,
                     scaler: dict | None = None, rng=None,
                     args: dict | None = None, bucket_size: int = 5_000_000,
                     torch_param_groups: list | None = None) -> str:
    """Write a complete TP=``tp``, DP=1 checkpoint in one process, crash-safe like a save.

    ``tensor(name, key, shape, dim)`` returns the full fp32 tensor of a parameter for
    ``key`` in ("master", "exp_avg", "exp_avg_sq") at ``shape`` (padding for ``tp``);
    ``rng``: the RNG state to store (a dict, or a function of the TP rank). The
    ZeRO files use the layout a real run at (tp, DP=1, ``bucket_size``) computes, so such a
    run resumes from them exactly; any other layout re-partitions as usual.
    """
    from dataclasses import replace

    from .model.gpt import GPTModel
    from .optimizer.layout import FlatLayout
    if os.path.isdir(root) and read_latest(root) is not None:
        raise CheckpointError(f"{root}: already holds a checkpoint; write to a new directory")
    # A meta model at TP=1 gives names, full shapes and partition metadata; multiplying the
    # divisor by tp pads the vocabulary exactly as a TP=tp model does.
    meta_cfg = replace(cfg, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by * tp)
    meta = GPTModel(meta_cfg, tp_group=ps.ParallelGroup.single(), device="meta")
    params = list(meta.named_parameters())
    info = {n: dict(shape=list(p.shape), tensor_model_parallel=bool(p.tensor_model_parallel),
                    partition_dim=int(p.partition_dim), stride=int(p.partition_stride))
            for n, p in params}
    final, tmp = iter_dir(root, iteration), os.path.join(root, f".tmp_iter_{iteration:07d}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    files = {}
    keys = ("master", "exp_avg", "exp_avg_sq")
    for r in range(tp):
        def local(name, key):
            i = info[name]
            t = tensor(name, key, i["shape"], i["partition_dim"])
            if i["tensor_model_parallel"]:
                t = split_for_rank(t, i["partition_dim"], tp, r, i["stride"])
            return t.float().contiguous()

        local_params = []  # this rank's shapes, for the flat layout its optimizer computes
        for n, p in params:
            shape = list(p.shape)
            if p.tensor_model_parallel:
                shape[p.partition_dim] //= tp
            lp = torch.empty(shape, device="meta")
            lp.tensor_model_parallel = p.tensor_model_parallel
            local_params.append((n, lp))
        weights = {n: local(n, "master").to(dtype) for n, _ in params}
        rel = os.path.join(f"mp_rank_{r:02d}", "model.pt")
        files[rel] = _write(weights, os.path.join(tmp, rel))
        if optimizer == "zero":
            layout = FlatLayout(local_params, 1, 0, r, bucket_size)
            flat = {k: torch.zeros(layout.host_numel) for k in keys}
            for k in keys:
                for slot, p_off, h_off, n in layout.owned_pieces():
                    flat[k][h_off:h_off + n] = local(slot.name, k).reshape(-1)[p_off:p_off + n]
            shard = dict(flat, step=step, scaler=scaler or {}, layout=layout.describe())
        else:  # torch.optim.AdamW's state: same numbering as FullTensors._local reads
            order = [n for n, p in params if p.ndim > 1] + [n for n, p in params if p.ndim <= 1]
            state = {i: {"step": torch.tensor(float(step)), "exp_avg": local(n, "exp_avg"),
                         "exp_avg_sq": local(n, "exp_avg_sq")} for i, n in enumerate(order)}
            shard = dict(torch_adamw=dict(state=state if step else {},
                                          param_groups=torch_param_groups))
        shard["rng"] = rng(r) if callable(rng) else rng if rng is not None else _rng_state()
        rel = _optim_file(r, 0)
        files[rel] = _write(shard, os.path.join(tmp, rel))
        del weights, shard
    common = dict(iteration=iteration, consumed_samples=consumed_samples, args=args or {})
    files["common.pt"] = _write(common, os.path.join(tmp, "common.pt"))
    manifest = dict(format_version=FORMAT_VERSION, iteration=iteration,
                    tensor_model_parallel_size=tp, data_parallel_size=1, optimizer=optimizer,
                    model_config=dataclasses.asdict(cfg), params=info, files=files)
    _write(json.dumps(manifest, indent=1), os.path.join(tmp, "manifest.json"), text=True)
    _fsync_dir(tmp)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write(str(iteration), os.path.join(root, LATEST + ".tmp"), text=True)
    os.replace(os.path.join(root, LATEST + ".tmp"), os.path.join(root, LATEST))
    _fsync_dir(root)
    return final
