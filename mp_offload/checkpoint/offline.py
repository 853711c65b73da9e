"""Checkpoints without process groups, for tools (convert, export, generate).

A tool reads any checkpoint in one process (or on every rank of a generation job), one
full parameter at a time (``FullTensors``), and can write a complete TP=k, DP=1
checkpoint (``write_checkpoint``) through the same commit sequence as a training save.
File names, checks and the TP merge come from ``on_disk``.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from .. import parallel_state as ps
from ..optimizer.base import DEFAULT_BUCKET_SIZE
from . import on_disk as fmt
from .errors import CheckpointError


def resolve_checkpoint(path: str, iteration: int | None = None) -> str:
    """The iteration directory meant by ``path``: a save root (its latest checkpoint, or
    ``iteration``) or an ``iter_XXXXXXX`` directory itself."""
    ckpt = fmt.find_checkpoint(path, iteration)
    if ckpt is None:
        raise CheckpointError(f"{path}: no {fmt.LATEST} and no {fmt.MANIFEST} (not a checkpoint)")
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"{ckpt}: missing (no checkpoint at iteration {iteration})")
    return ckpt


def config_from_manifest(manifest: dict):
    from ..model.gpt import GPTConfig  # deferred: the model is not needed to save/load

    known = {f.name for f in dataclasses.fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in manifest["model_config"].items() if k in known})


class FullTensors:
    """Full (TP-merged) fp32 tensors of one checkpoint, built one parameter at a time.

    ``get(name, key)``: key "master" (the weights), "exp_avg" or "exp_avg_sq" (Adam
    moments). Tensors keep the saved vocabulary padding (see ``on_disk.fit_padding``).
    Reads zero (fp32 master slices) and torch-adamw (fp32 model.pt + torch state)
    checkpoints.
    """

    def __init__(self, ckpt: str):
        self.ckpt = ckpt
        self.manifest = fmt.read_manifest(ckpt)
        self.read = fmt.CheckedReader(ckpt, self.manifest)
        self.config = config_from_manifest(self.manifest)
        self.names = list(self.manifest["params"])
        self.tp = self.manifest["tensor_model_parallel_size"]
        self.kind = self.manifest["optimizer"]
        if self.kind not in ("zero", "torch-adamw"):
            raise CheckpointError(f"{ckpt}: unknown optimizer {self.kind!r}")
        order = fmt.torch_adamw_order(self.manifest["params"])
        self.adamw_index = {n: i for i, n in enumerate(order)}

    def common(self) -> dict:
        return self.read(fmt.COMMON)

    def shard0(self) -> dict:
        """TP rank 0 / DP rank 0's optimizer file: step, scaler, RNG (same on every rank)."""
        return self.read(fmt.optim_file(0, 0))

    def compute_dtype(self) -> torch.dtype:
        """The dtype the run kept its weights in (model.pt)."""
        return next(iter(self.read(fmt.model_file(0)).values())).dtype

    def _local(self, name: str, tp_rank: int, key: str, shape) -> torch.Tensor:
        if self.kind == "zero":
            return fmt.zero_local(self.read, self.manifest, name, tp_rank, key, shape)
        if key == "master":
            return self.read(fmt.model_file(tp_rank))[name].float()
        state = self.read(fmt.optim_file(tp_rank, 0))["torch_adamw"]["state"]
        entry = state.get(self.adamw_index[name])
        if entry is None:  # never stepped: zero moments
            return torch.zeros(shape, dtype=torch.float32)
        return entry[key].float().reshape(shape)

    def get(self, name: str, key: str = "master") -> torch.Tensor:
        return fmt.merge_param(
            self.manifest, name, lambda r, shape: self._local(name, r, key, shape)
        )


def load_weights_resharded(ckpt: str, model) -> None:
    """Copy a checkpoint's weights into ``model``'s TP slice (any saved TP size).

    Needs no optimizer and no collective: each rank merges the full tensor of one
    parameter, re-pads the vocabulary for its TP size and keeps its own slice.
    """
    full = FullTensors(ckpt)
    tp, rank = model.tp_group.size, model.tp_group.rank
    info = fmt.param_info(model.named_parameters(), tp)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in full.manifest["params"]:
                raise CheckpointError(f"{ckpt}: has no parameter {name}")
            t = fmt.local_slice(full.get(name), info[name], tp, rank)
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(
                    f"{ckpt}: {name} has shape {tuple(t.shape)}, the model wants {tuple(p.shape)}"
                )
            p.copy_(t)


# ------------------------------------------------------------------------ writing
@dataclasses.dataclass
class _Plan:
    """What ``write_checkpoint`` writes for every TP rank (see its docstring)."""

    tp: int
    tensor: object  # tensor(name, key, shape, dim) -> full fp32 tensor
    params: list  # (name, meta parameter at TP=1 with the padding of TP=tp)
    info: dict  # the manifest's params
    dtype: torch.dtype
    optimizer: str
    step: int
    scaler: dict | None
    rng: object
    bucket_size: int
    torch_param_groups: list | None

    def local(self, name: str, key: str, tp_rank: int) -> torch.Tensor:
        i = self.info[name]
        full = self.tensor(name, key, i["shape"], i["partition_dim"])
        return fmt.local_slice(full, i, self.tp, tp_rank).float().contiguous()

    def local_meta_params(self) -> list:
        """This TP rank's parameter shapes, for the flat layout its optimizer computes."""
        out = []
        for n, p in self.params:
            shape = list(p.shape)
            if p.tensor_model_parallel:
                shape[p.partition_dim] //= self.tp
            lp = torch.empty(shape, device="meta")
            lp.tensor_model_parallel = p.tensor_model_parallel
            out.append((n, lp))
        return out


def _meta_params(cfg, tp: int) -> list:
    """Names, full shapes and partition metadata from a meta model at TP=1; multiplying
    the divisor by ``tp`` pads the vocabulary exactly as a TP=``tp`` model does."""
    from ..model.gpt import GPTModel  # deferred: only the writer builds a model

    meta_cfg = dataclasses.replace(
        cfg, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by * tp
    )
    meta = GPTModel(meta_cfg, tp_group=ps.ParallelGroup.single(), device="meta")
    return list(meta.named_parameters())


def _zero_shard(plan: _Plan, tp_rank: int) -> dict:
    """The ZeRO optimizer file of a run at (TP=plan.tp, DP=1, plan.bucket_size)."""
    from ..optimizer.layout import FlatLayout

    layout = FlatLayout(plan.local_meta_params(), 1, 0, tp_rank, plan.bucket_size)
    flat = {}
    for k in ("master", "exp_avg", "exp_avg_sq"):
        flat[k] = torch.zeros(layout.slice_numel)
        for slot, p_off, h_off, n in layout.owned_pieces():
            src = plan.local(slot.name, k, tp_rank).reshape(-1)
            flat[k][h_off : h_off + n] = src[p_off : p_off + n]
    return dict(flat, step=plan.step, scaler=plan.scaler or {}, layout=layout.describe())


def _adamw_shard(plan: _Plan, tp_rank: int) -> dict:
    """torch.optim.AdamW's state, numbered as ``on_disk.torch_adamw_order`` says."""
    state = {
        i: {
            "step": torch.tensor(float(plan.step)),
            "exp_avg": plan.local(n, "exp_avg", tp_rank),
            "exp_avg_sq": plan.local(n, "exp_avg_sq", tp_rank),
        }
        for i, n in enumerate(fmt.torch_adamw_order(plan.info))
    }
    return {
        "torch_adamw": {
            "state": state if plan.step else {},
            "param_groups": plan.torch_param_groups,
        }
    }


def _write_rank(plan: _Plan, tmp: str, tp_rank: int) -> dict:
    """Write TP rank ``tp_rank``'s model.pt and optimizer file; their manifest entries."""
    files = {}
    weights = {n: plan.local(n, "master", tp_rank).to(plan.dtype) for n, _ in plan.params}
    rel = fmt.model_file(tp_rank)
    files[rel] = fmt.write_file(weights, os.path.join(tmp, rel))
    del weights
    shard = _zero_shard(plan, tp_rank) if plan.optimizer == "zero" else _adamw_shard(plan, tp_rank)
    rng = plan.rng
    shard["rng"] = rng(tp_rank) if callable(rng) else rng if rng is not None else fmt.rng_state()
    rel = fmt.optim_file(tp_rank, 0)
    files[rel] = fmt.write_file(shard, os.path.join(tmp, rel))
    return files


def write_checkpoint(
    root: str,
    iteration: int,
    consumed_samples: int,
    cfg,
    tp: int,
    tensor,
    *,
    dtype=torch.float32,
    optimizer: str = "zero",
    step: int = 0,
    scaler: dict | None = None,
    rng=None,
    args: dict | None = None,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    torch_param_groups: list | None = None,
    tokenizer_data: dict | None = None,
) -> str:
    """Write a complete TP=``tp``, DP=1 checkpoint in one process, crash-safe like a save.

    Its tokenizer files (those ``tokenizer_data``, else ``args["data"]``, names that
    exist) are copied in, as a save does, so the new checkpoint works from anywhere.

    ``tensor(name, key, shape, dim)`` returns the full fp32 tensor of a parameter for
    ``key`` in ("master", "exp_avg", "exp_avg_sq") at ``shape`` (padding for ``tp``);
    ``rng``: the RNG state to store (a dict, or a function of the TP rank). The
    ZeRO files use the layout a real run at (tp, DP=1, ``bucket_size``) computes, so such a
    run resumes from them exactly; any other layout re-partitions as usual.
    """
    if os.path.isdir(root) and fmt.read_latest(root) is not None:
        raise CheckpointError(f"{root}: already holds a checkpoint; write to a new directory")
    params = _meta_params(cfg, tp)
    plan = _Plan(
        tp=tp,
        tensor=tensor,
        params=params,
        info=fmt.param_info(params, 1),
        dtype=dtype,
        optimizer=optimizer,
        step=step,
        scaler=scaler,
        rng=rng,
        bucket_size=bucket_size,
        torch_param_groups=torch_param_groups,
    )
    tmp = fmt.start_save(root, iteration)
    files = {}
    for r in range(tp):
        files.update(_write_rank(plan, tmp, r))
    data = tokenizer_data if tokenizer_data is not None else (args or {}).get("data", {})
    tok_entries, tok_stored = fmt.copy_tokenizer(data, tmp)
    files.update(tok_entries)
    common = {
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "args": args or {},
        "tokenizer_files": tok_stored,
    }
    files[fmt.COMMON] = fmt.write_file(common, os.path.join(tmp, fmt.COMMON))
    manifest = fmt.make_manifest(
        iteration=iteration,
        tp=tp,
        dp=1,
        optimizer=optimizer,
        model_config=dataclasses.asdict(cfg),
        params=plan.info,
        files=files,
    )
    return fmt.commit(root, iteration, manifest)


def merge_checkpoint(ckpt: str, save: str, bucket_size: int | None = None) -> str:
    """Write ``ckpt`` (any TP/DP) as a TP=1, DP=1 checkpoint at the same iteration, with
    the merged fp32 master, Adam moments, step, loss scale and RNG: a run at TP=1, DP=1
    continues from it exactly; any other size re-partitions it as usual."""
    full = FullTensors(ckpt)
    common, shard = full.common(), full.shard0()
    args = {k: dict(v) for k, v in common.get("args", {}).items()}
    if "parallel" in args:
        args["parallel"]["tensor_model_parallel_size"] = 1

    def tensor(name, key, shape, dim):
        return fmt.fit_padding(full.get(name, key), shape, max(dim, 0))

    if full.kind == "zero":
        step, scaler, groups = shard["step"], shard["scaler"], None
        bucket_size = bucket_size or shard["layout"]["bucket_size"]
    else:
        state = shard["torch_adamw"]
        steps = [float(s["step"]) for s in state["state"].values()]
        step, scaler, groups = int(max(steps, default=0)), None, state["param_groups"]
    return write_checkpoint(
        save,
        common["iteration"],
        common["consumed_samples"],
        full.config,
        1,
        tensor,
        dtype=full.compute_dtype(),
        optimizer=full.kind,
        step=step,
        scaler=scaler,
        rng=shard["rng"],
        args=args,
        bucket_size=bucket_size or DEFAULT_BUCKET_SIZE,
        torch_param_groups=groups,
        tokenizer_data=fmt.tokenizer_args(ckpt, common),  # the originals, else its copies
    )
