"""The collective load: exact resume at the saved sizes, re-partitioning at any others.

At the saved TP/DP sizes and layout each rank takes its own optimizer slice as saved.
(torch-adamw checkpoints hold torch's own state and reload only at the saved sizes.)
Otherwise every rank rebuilds its new slice one parameter at a time (merge the saved
DP slices and TP shards of that parameter, re-pad the vocabulary, keep its piece), so
no rank ever holds the whole optimizer state. Everything that can fail runs before
the one collective that shares the errors, so a bad file fails every rank, never hangs.
"""

from __future__ import annotations

import torch

from .. import parallel_state as ps
from ..tensor_parallel.random import get_rng_tracker, model_parallel_seed
from . import on_disk as fmt
from .errors import CheckpointError, raise_agreed


def _resharded(read, manifest, name: str, p, key: str) -> torch.Tensor:
    """``name``'s tensor for this rank's TP slice, re-split from the saved TP layout."""
    full = fmt.merge_param(
        manifest, name, lambda r, shape: fmt.zero_local(read, manifest, name, r, key, shape)
    )
    tp = ps.get_tensor_model_parallel_world_size()
    info = fmt.param_info([(name, p)], tp)[name]
    return fmt.local_slice(full, info, tp, ps.get_tensor_model_parallel_rank())


def _read_zero(read, manifest, optimizer, load_optim: bool):
    """Phase 1 (no collectives): this rank's new slice tensors, its saved shard, and the
    shard whose RNG this rank resumes (None when the layout changed)."""
    tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    same = (
        manifest["tensor_model_parallel_size"] == ps.get_tensor_model_parallel_world_size()
        and manifest["data_parallel_size"] == ps.get_data_parallel_world_size()
    )
    own = read(fmt.optim_file(tp_rank, dp_rank)) if same else None
    keys = ("master", "exp_avg", "exp_avg_sq") if load_optim else ("master",)
    if own is not None and own["layout"] == optimizer.layout.describe():
        return {k: own[k] for k in keys}, own, own  # exact resume: the slice as saved
    tensors = {k: torch.zeros(optimizer.layout.slice_numel) for k in keys}
    # Re-partition: each parameter owns at most one piece of this slice; build it, copy it.
    for slot, p_off, h_off, n in optimizer.layout.owned_pieces():
        for k in keys:
            full = _resharded(read, manifest, slot.name, slot.param, k).reshape(-1)
            tensors[k][h_off : h_off + n] = full[p_off : p_off + n]
    return tensors, read(fmt.optim_file(0, 0)), None


def _install_zero(optimizer, tensors, shard, load_optim: bool) -> None:
    """Phase 2 (collective: republishes the device params)."""
    if load_optim:
        optimizer.load_state_dict(dict(tensors, step=shard["step"], scaler=shard["scaler"]))
    else:
        optimizer.load_state_dict({"master": tensors["master"]})


def _restore_rng(rng: dict, seed: int, log) -> None:
    """Resume the saved RNG streams, or reseed them when they were saved on another
    device type: a CPU generator state fed to CUDA (or the reverse) is the wrong size,
    and the first dropout would fail."""
    tracker = get_rng_tracker()
    saved = fmt.rng_device(rng)
    if saved != tracker.device:
        model_parallel_seed(seed, ps.get_tensor_model_parallel_rank(), tracker.device)
        if log:
            log(
                f"RNG state was saved on {saved}, this run is on {tracker.device}: reseeded "
                f"from --seed {seed} (dropout differs from an unbroken run)"
            )
        return
    torch.set_rng_state(rng["cpu"])
    tracker.set_states(rng["tracker"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def _stage_torch_adamw(read, manifest, model, optimizer, load_optim: bool):
    """Phase 1 of a torch-adamw load: (install, own shard). torch's state is not
    partitioned by us, so it reloads only at the saved sizes."""
    if (
        manifest["tensor_model_parallel_size"] != ps.get_tensor_model_parallel_world_size()
        or manifest["data_parallel_size"] != ps.get_data_parallel_world_size()
    ):
        raise CheckpointError(
            f"{read.ckpt}: torch-adamw checkpoints reload only at the same "
            f"TP/DP sizes; use --optimizer adam to reshard"
        )
    tp_rank = ps.get_tensor_model_parallel_rank()
    weights = read(fmt.model_file(tp_rank))
    own = read(fmt.optim_file(tp_rank, ps.get_data_parallel_rank()))

    @torch.no_grad()
    def install():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
        if load_optim:
            optimizer.load_state_dict(own["torch_adamw"])

    return install, own


def _stage(root: str, model, optimizer, args, load_optim: bool):
    """Phase 1 of a load (reads and checks, no collectives): None when nothing is saved,
    else ((iteration, consumed), install, shard whose RNG this rank resumes or None)."""
    ckpt = fmt.find_checkpoint(root)
    if ckpt is None:
        return None
    manifest = fmt.read_manifest(ckpt)
    fmt.check_model_shape(manifest, ckpt, args.model)
    read = fmt.CheckedReader(ckpt, manifest)
    common = read(fmt.COMMON)
    result = (common["iteration"], common["consumed_samples"])
    kind = optimizer.checkpoint_kind
    if manifest["optimizer"] != kind:
        raise CheckpointError(
            f"{ckpt}: saved with optimizer {manifest['optimizer']}, "
            f"this run uses --optimizer {args.optim.optimizer}"
        )
    if kind == "torch-adamw":
        return (result, *_stage_torch_adamw(read, manifest, model, optimizer, load_optim))
    tensors, shard, own = _read_zero(read, manifest, optimizer, load_optim)
    return result, lambda: _install_zero(optimizer, tensors, shard, load_optim), own


def load_checkpoint(
    root: str, model, optimizer, args, *, load_optim: bool = True, load_rng: bool = True, log=None
) -> tuple[int, int] | None:
    """Collective. Returns (iteration, consumed_samples), or None when nothing is saved.

    ``root``: a save root (its latest checkpoint) or one ``iter_*`` directory (that
    iteration). Any rank's failure is raised on every rank (the first failing rank's
    message). ``log(line)`` hears of a reseeded RNG (saved on another device type).
    """
    error, staged = None, None
    try:
        staged = _stage(root, model, optimizer, args, load_optim)
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - an unreadable file must not hang the others
        error = f"checkpoint in {root}: {type(e).__name__}: {e}"
    raise_agreed(error)
    if staged is None:
        return None
    result, install, own = staged
    install()  # collective for ZeRO (republishes the device params)
    if own is not None and load_rng:
        _restore_rng(own["rng"], args.train.seed, log)
    return result
