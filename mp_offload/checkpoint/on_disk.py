"""The on-disk checkpoint format: the only module that knows file names and what they hold.

Layout::

    <root>/latest_checkpointed_iteration.txt       the newest complete iteration
    <root>/.lock                                   held by the job saving here (guard.py)
    <root>/iter_0000100/manifest.json              format, sizes, model config, params,
                                                   size + sha256 of every other file
    <root>/iter_0000100/manifest.sha256            sha256 of manifest.json (sha256sum -c)
    <root>/iter_0000100/common.pt                  iteration, consumed samples, arguments
    <root>/iter_0000100/mp_rank_00/model.pt        TP shard of the weights (compute dtype)
    <root>/iter_0000100/mp_rank_00/optim_dp000.pt  this (TP, DP) rank's fp32 master/m/v
                                                   slice, its layout, step, scaler, RNG
    <root>/iter_0000100/mp_rank_00/optim_dp000.exp_avg.f32   a state key written a chunk
                                                   at a time (raw little-endian fp32)

Owned here, and nowhere else: the names above, the manifest (build, read, check), the
commit sequence both writers use (temporary directory, fsync, manifest last, rename,
then the latest pointer), the checked reader (size and sha256 once, then mmap), the
vocabulary-padding fit, and the TP merge of one parameter from its saved slices.
Nothing here needs process groups.

Versions: 4 (written now) writes a state key whose stored form is not fp32 on the host
(remainders, 8-bit moments, a device share) as a raw fp32 file beside the optimizer
file, converted a chunk at a time, so a save holds no fp32 copy of the compact state;
the optimizer file names it (``{"raw_fp32": file, "numel": n}``) and the checked reader
maps it in place of the tensor. 3 may save an optimizer slice as its parts in order (device
share, host part) when the run split it (``--optimizer-offload-fraction``), so a save
never concatenates them; ``saved_range`` reads either form. 2 added manifest.sha256, so
a hand-edited manifest is refused instead of silently loading wrong weights, and the
device of each RNG record. 1 is still read: no manifest checksum, and the RNG device
follows from the state size.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from math import inf

import torch

from ..model.gpt_config import OPTION_FIELDS, SHAPE_FIELDS, GPTConfig
from ..optimizer.layout import layout_from_description
from ..runtime import faults
from ..tensor_parallel.random import get_rng_tracker
from ..tensor_parallel.utils import merge_partitions, split_for_rank
from .errors import CheckpointError

FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
LATEST = "latest_checkpointed_iteration.txt"
LOCK = ".lock"
MANIFEST = "manifest.json"
MANIFEST_SHA = "manifest.sha256"
COMMON = "common.pt"
TOKENIZER_DIR = "tokenizer"  # copies of the run's tokenizer files
TOKENIZER_FIELDS = ("tokenizer_model", "vocab_file", "merge_file")  # DataConfig paths
TMP_PREFIX = ".tmp_iter_"
_ITER_NAME = re.compile(r"iter_(\d{7,})")


# ------------------------------------------------------------------------- names
def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def is_complete(root: str, iteration: int) -> bool:
    """The checkpoint of ``iteration`` under ``root`` was committed (its manifest is there)."""
    return os.path.exists(os.path.join(iter_dir(root, iteration), MANIFEST))


def tmp_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"{TMP_PREFIX}{iteration:07d}")


def model_file(tp_rank: int) -> str:
    """Relative to the iteration directory."""
    return os.path.join(f"mp_rank_{tp_rank:02d}", "model.pt")


def optim_file(tp_rank: int, dp_rank: int) -> str:
    """Relative to the iteration directory."""
    return os.path.join(f"mp_rank_{tp_rank:02d}", f"optim_dp{dp_rank:03d}.pt")


def raw_file(optim_rel: str, key: str) -> str:
    """The raw fp32 file of state ``key`` beside the optimizer file ``optim_rel``."""
    return f"{optim_rel[: -len('.pt')]}.{key}.f32"


def iteration_of(path: str) -> int | None:
    """The iteration an ``iter_XXXXXXX`` directory name stands for, else None."""
    m = _ITER_NAME.fullmatch(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def list_iterations(root: str) -> list[int]:
    """Iterations with a directory in ``root`` (complete saves only: temporaries are hidden)."""
    if not os.path.isdir(root):
        return []
    its = (iteration_of(d) for d in os.listdir(root))
    return sorted(i for i in its if i is not None)


def read_latest(root: str) -> int | None:
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text[:40]!r}")
    return int(text)


def find_checkpoint(path: str, iteration: int | None = None) -> str | None:
    """The iteration directory ``path`` means: ``path`` itself when it is one (it has a
    manifest or an ``iter_*`` name), else the save root's ``iteration`` or latest one;
    None when the root has no latest pointer (nothing saved there)."""
    if iteration is None and (
        os.path.exists(os.path.join(path, MANIFEST)) or iteration_of(path) is not None
    ):
        return path
    if iteration is None:
        iteration = read_latest(path)
        if iteration is None:
            return None
    return iter_dir(path, iteration)


# ------------------------------------------------------------------- tokenizer
def tokenizer_files(data_args: dict) -> dict[str, str]:
    """DataConfig field -> the file it names, for the run's tokenizer files that exist (a
    HuggingFaceTokenizer directory stands for its tokenizer.json)."""
    out = {}
    for field in TOKENIZER_FIELDS:
        path = data_args.get(field)
        if path and os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if path and os.path.isfile(path):
            out[field] = path
    return out


def copy_tokenizer(data_args: dict, tmp: str) -> tuple[dict, dict]:
    """Copy the tokenizer files into the save; returns (manifest entries, field -> path
    relative to the iteration directory). Generation and export use the copies when the
    original files have moved, so a checkpoint works from any directory."""
    entries, stored = {}, {}
    for field, src in tokenizer_files(data_args).items():
        rel = os.path.join(TOKENIZER_DIR, f"{field}-{os.path.basename(src)}")
        dst = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            shutil.copyfileobj(fi, fo)
            fo.flush()
            os.fsync(fo.fileno())
        entries[rel] = dict(bytes=os.path.getsize(dst), sha256=sha256_file(dst))
        stored[field] = rel
    return entries, stored


def tokenizer_args(ckpt: str, common: dict) -> dict:
    """The run's data args, with each tokenizer path that no longer exists replaced by the
    checkpoint's own copy."""
    data = dict(common.get("args", {}).get("data", {}))
    for field, rel in common.get("tokenizer_files", {}).items():
        if not (data.get(field) and os.path.exists(data[field])):
            data[field] = os.path.join(ckpt, rel)
    return data


# ------------------------------------------------------------------------ writing
def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_file(obj, path: str, text: bool = False) -> dict:
    """torch.save ``obj`` (or write the string) durably; returns its manifest entry."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w" if text else "wb") as f:
        if text:
            f.write(obj)
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}


def write_raw(chunks, path: str, finite: bool = False) -> tuple[dict, bool]:
    """Write fp32 ``chunks`` (an iterator) one after another, durably: (the manifest
    entry, whether every value was finite when ``finite`` is asked, else True). Only one
    chunk is held at a time."""
    ok = True
    with open(path, "wb") as f:
        for c in chunks:
            c = c.to(torch.float32).contiguous()
            # the inf-norm: a reduction with no temporary the size of the chunk
            ok = ok and (not finite or bool(torch.linalg.vector_norm(c, inf).isfinite()))
            f.write(c.numpy().data)  # little-endian fp32, as torch.from_file reads it
            del c  # before the next chunk is made: one at a time
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}, ok


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict:
    """The RNG record each optimizer file stores: the default generators, and the TP
    tracker's states with the device they belong to (their format depends on it)."""
    tracker = get_rng_tracker()
    state = {
        "cpu": torch.get_rng_state(),
        "tracker": tracker.get_states(),
        "device": tracker.device,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def rng_device(rng: dict) -> str:
    """The device of a saved RNG record's tracker states. Version 1 did not say; a CPU
    generator state has a fixed size that no CUDA (Philox seed + offset) state has."""
    if "device" in rng:
        return rng["device"]
    states = list(rng["tracker"].values())
    cpu_size = torch.get_rng_state().numel()
    return "cpu" if not states or states[0].numel() == cpu_size else "cuda"


def param_info(named_params, tp: int) -> dict:
    """The manifest's ``params``: full shape and partitioning of every parameter."""
    info = {}
    for name, p in named_params:
        shape = list(p.shape)
        if p.tensor_model_parallel:
            shape[p.partition_dim] *= tp
        info[name] = {
            "shape": shape,
            "tensor_model_parallel": bool(p.tensor_model_parallel),
            "partition_dim": int(p.partition_dim),
            "stride": int(p.partition_stride),
        }
    return info


def torch_adamw_order(params: dict) -> list[str]:
    """Parameter names in torch.optim.AdamW's state numbering: matrices first, then 1-D
    ones (optimizer/torch_adamw.py: param_groups), each in model order."""
    names = list(params)
    ndim = {n: len(i["shape"]) for n, i in params.items()}
    return [n for n in names if ndim[n] > 1] + [n for n in names if ndim[n] <= 1]


def make_manifest(
    *,
    iteration: int,
    tp: int,
    dp: int,
    optimizer: str,
    model_config: dict,
    params: dict,
    files: dict,
) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "tensor_model_parallel_size": tp,
        "data_parallel_size": dp,
        "optimizer": optimizer,
        "model_config": model_config,
        "params": params,
        "files": files,
    }


def start_save(root: str, iteration: int) -> str:
    """Make the save's temporary directory (after removing those of killed saves)."""
    os.makedirs(root, exist_ok=True)
    for d in os.listdir(root):
        if d.startswith(TMP_PREFIX):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    tmp = tmp_dir(root, iteration)
    os.makedirs(tmp)
    return tmp


def commit(root: str, iteration: int, manifest: dict) -> str:
    """Finish a save whose files are all in ``tmp_dir``: manifest last, rename, pointer.

    A process killed at any point leaves the previous checkpoint loadable: until the
    rename the new one is hidden, and the pointer moves only once it is in place.
    """
    tmp, final = tmp_dir(root, iteration), iter_dir(root, iteration)
    faults.checkpoint_point("before_manifest", iteration)
    meta = write_file(json.dumps(manifest, indent=1), os.path.join(tmp, MANIFEST), text=True)
    write_file(f"{meta['sha256']}  {MANIFEST}\n", os.path.join(tmp, MANIFEST_SHA), text=True)
    fsync_dir(tmp)
    faults.checkpoint_point("before_rename", iteration)
    old = final + ".old"
    if os.path.exists(final):  # re-saving an iteration: the old copy goes only after
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(root)
    write_file(str(iteration), os.path.join(root, LATEST + ".tmp"), text=True)
    os.replace(os.path.join(root, LATEST + ".tmp"), os.path.join(root, LATEST))
    fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    return final


def prune(root: str, keep: int, newest: int, protect: int | None = None) -> None:
    """Keep the newest ``keep`` iterations (and ``newest`` whatever the others are), and
    ``protect``: the last checkpoint before a run of skipped fp16 steps, which the
    checkpoints taken during that run must not rotate out."""
    for it in list_iterations(root)[:-keep]:
        if it not in (newest, protect):
            shutil.rmtree(iter_dir(root, it), ignore_errors=True)


# ------------------------------------------------------------------------ reading
def _check_manifest_sha(ckpt: str, data: bytes, version) -> None:
    """The manifest must match manifest.sha256 (version 2 on; version 1 has none)."""
    path = os.path.join(ckpt, MANIFEST_SHA)
    if not os.path.exists(path):
        if version == 1:
            return
        raise CheckpointError(f"{path}: missing (version {version} checkpoints have one)")
    with open(path) as f:
        want = f.read().split(maxsplit=1)[:1]
    if want != [hashlib.sha256(data).hexdigest()]:
        raise CheckpointError(
            f"{os.path.join(ckpt, MANIFEST)}: does not match {path} "
            f"(edited or corrupted); refusing to load it"
        )


def read_manifest(ckpt: str) -> dict:
    """The manifest of an iteration directory, after the format checks."""
    path = os.path.join(ckpt, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing (incomplete save?)")
    with open(path, "rb") as f:
        data = f.read()
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path}: format version {version}, this code reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    _check_manifest_sha(ckpt, data, version)
    return manifest


def check_model_shape(manifest: dict, ckpt: str, model_cfg) -> None:
    """Refuse a checkpoint of another model shape, naming the flag that differs."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    # Rope options left unset mean their defaults: a flag giving those is the same model.
    unset = dict(zip(("rotary_base", "rotary_percent"), GPTConfig().rotary))
    saved = manifest["model_config"]
    for f in SHAPE_FIELDS + OPTION_FIELDS:
        here, there = (
            unset.get(f) if v is None else v
            for v in (getattr(model_cfg, f, defaults.get(f)), saved.get(f, defaults.get(f)))
        )
        if there != here:
            flag = "--" + f.replace("_", "-")
            raise CheckpointError(
                f"{os.path.join(ckpt, MANIFEST)}: {flag} is {here} here but "
                f"{there} in the checkpoint"
            )


class CheckedReader:
    """Opens checkpoint files lazily (mmap) after checking size and checksum once."""

    def __init__(self, ckpt: str, manifest: dict):
        self.ckpt, self.files, self.cache = ckpt, manifest["files"], {}
        self.layouts = {}

    def __call__(self, rel: str) -> dict:
        if rel not in self.cache:
            obj = torch.load(self._checked(rel), mmap=True, weights_only=True, map_location="cpu")
            if isinstance(obj, dict):  # a raw state key: mapped, read as its pages are
                for k, v in obj.items():
                    if isinstance(v, dict) and "raw_fp32" in v:
                        path = self._checked(v["raw_fp32"])
                        obj[k] = torch.from_file(path, size=v["numel"], dtype=torch.float32)
            self.cache[rel] = obj
        return self.cache[rel]

    def _checked(self, rel: str) -> str:
        """The path of listed file ``rel`` once its size and checksum match the manifest."""
        path = os.path.join(self.ckpt, rel)
        meta = self.files.get(rel)
        if meta is None or not os.path.exists(path):
            raise CheckpointError(f"{path}: missing (the checkpoint lists {len(self.files)} files)")
        size = os.path.getsize(path)
        if size != meta["bytes"]:
            raise CheckpointError(
                f"{path}: truncated or altered ({size} bytes, manifest says {meta['bytes']})"
            )
        if sha256_file(path) != meta["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch (corrupted)")
        return path

    def pieces(self, tp_rank: int, dp_rank: int) -> dict:
        """name -> [(offset in param, offset in slice, length)] of a saved (TP, DP) slice."""
        key = (tp_rank, dp_rank)
        if key not in self.layouts:
            layout = layout_from_description(self(optim_file(*key))["layout"], dp_rank)
            by_name = {}
            for slot, p_off, h_off, n in layout.owned_pieces():
                by_name.setdefault(slot.name, []).append((p_off, h_off, n))
            self.layouts[key] = by_name
        return self.layouts[key]


def saved_range(value, lo: int, n: int) -> torch.Tensor:
    """Elements [lo, lo + n) of a saved optimizer slice: one tensor, or its parts in order.
    A view when they lie in one part, as a parameter's piece always does (the parts are
    cut at a bucket boundary and a piece lies inside one bucket)."""
    if not isinstance(value, (list, tuple)):
        return value[lo : lo + n]
    pieces = []
    for part in value:
        if lo < part.numel():
            pieces.append(part[lo : lo + n])
            n -= pieces[-1].numel()
            if n <= 0:
                break
        lo = max(lo - part.numel(), 0)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def zero_local(
    read: CheckedReader, manifest: dict, name: str, tp_rank: int, key: str, shape
) -> torch.Tensor:
    """One parameter's TP-local fp32 tensor (``key``: master, exp_avg or exp_avg_sq) of a
    ZeRO checkpoint, assembled from the DP slices that hold its pieces."""
    out = torch.zeros(int(torch.Size(shape).numel()), dtype=torch.float32)
    for b in range(manifest["data_parallel_size"]):
        src = read(optim_file(tp_rank, b))[key]
        for p_off, h_off, n in read.pieces(tp_rank, b).get(name, ()):
            out[p_off : p_off + n] = saved_range(src, h_off, n)
    return out.view(shape)


def merge_param(manifest: dict, name: str, local) -> torch.Tensor:
    """The full tensor of ``name`` at the saved padding, merged from ``local(tp_rank,
    local_shape)`` of every saved TP rank (one rank's tensor if it is not TP-split)."""
    info, tp = manifest["params"][name], manifest["tensor_model_parallel_size"]
    if not info["tensor_model_parallel"]:
        return local(0, info["shape"])
    dim, stride = info["partition_dim"], info["stride"]
    shape = list(info["shape"])
    shape[dim] //= tp
    return merge_partitions([local(r, shape) for r in range(tp)], dim, stride)


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


def local_slice(full: torch.Tensor, info: dict, tp: int, tp_rank: int) -> torch.Tensor:
    """``tp_rank``'s slice of a full tensor for a model at TP=``tp`` whose full shape and
    partitioning are ``info`` (a ``param_info`` entry); the vocabulary is re-padded."""
    if not info["tensor_model_parallel"]:
        return full
    dim = info["partition_dim"]
    return split_for_rank(fit_padding(full, info["shape"], dim), dim, tp, tp_rank, info["stride"])
