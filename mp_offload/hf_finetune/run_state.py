"""A fine-tuning run's checkpoints and its Hugging Face export.

A checkpoint is ``SAVE/iter_NNNNNNN/``: ``optimizer.pt`` (``OffloadAdamW.state_dict()``:
the fp32 master, which is the model's trainable weights, and the moments, by parameter
name, so it loads at any data-parallel size), ``trainer.json`` (iteration, consumed
samples, the run's settings) and ``rng_<rank>.pt`` (each rank's random state). It is
written into ``iter_NNNNNNN.tmp`` and renamed into place once every rank has written
its part, then ``latest_checkpointed_iteration.txt`` names it: a crash mid-save leaves
the previous checkpoint as the latest.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import torch
import torch.distributed as dist

from . import BadInput

TRACKER = "latest_checkpointed_iteration.txt"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rng_state() -> dict:
    state = dict(torch=torch.get_rng_state(), python=random.getstate())
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(opt, save_dir: str, iteration: int, consumed: int, settings: dict) -> str:
    """Write the checkpoint of ``iteration`` (collective); returns its directory."""
    state = opt.state_dict()  # collective: DP rank 0 (global rank 0 here) holds the state
    rank, final = _rank(), os.path.join(save_dir, f"iter_{iteration:07d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    if rank == 0:
        torch.save(state, os.path.join(tmp, "optimizer.pt"))
        trainer = dict(iteration=iteration, consumed_samples=consumed, settings=settings)
        with open(os.path.join(tmp, "trainer.json"), "w") as f:
            json.dump(trainer, f, indent=1)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_{rank}.pt"))
    _barrier()
    if rank == 0:
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(os.path.join(save_dir, TRACKER + ".tmp"), "w") as f:
            f.write(f"{iteration}\n")
        os.replace(os.path.join(save_dir, TRACKER + ".tmp"), os.path.join(save_dir, TRACKER))
    _barrier()
    return final


def find(load: str) -> str:
    """The checkpoint directory ``--load`` names: one ``iter_*`` directory, or the one a
    save directory's tracker names. BadInput when there is none."""
    if os.path.isfile(os.path.join(load, "optimizer.pt")):
        return load
    tracker = os.path.join(load, TRACKER)
    if not os.path.isfile(tracker):
        what = "no such directory" if not os.path.isdir(load) else f"no {TRACKER} in it"
        raise BadInput(f"--load {load}: {what}")
    with open(tracker) as f:
        text = f.read().strip()
    path = os.path.join(load, f"iter_{int(text):07d}") if text.isdigit() else ""
    if not os.path.isfile(os.path.join(path, "optimizer.pt")):
        raise BadInput(f"--load {load}: {TRACKER} names {text!r}, which holds no optimizer.pt")
    return path


def load(opt, path: str, seed: int) -> dict:
    """Restore the optimizer (and so the model's weights) and this rank's random state
    from the checkpoint ``path``; returns its trainer.json. A rank the saving run did not
    have (a larger data-parallel size) is reseeded from ``seed``, its rank and the
    iteration."""
    with open(os.path.join(path, "trainer.json")) as f:
        trainer = json.load(f)
    state = torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu", mmap=True,
                       weights_only=True)  # fmt: skip
    opt.load_state_dict(state)
    rng = os.path.join(path, f"rng_{_rank()}.pt")
    if os.path.isfile(rng):
        _set_rng_state(torch.load(rng, weights_only=False))
    else:
        torch.manual_seed(seed + 1000 * _rank() + trainer["iteration"])
        random.seed(seed + _rank())
    return trainer


def _caster(opt, dtype: torch.dtype):
    """fp32 master -> ``dtype`` by the rule the optimizer makes its bf16 weights with
    (with offload: split_fp32's, which rounds ties away from zero where ``Tensor.to`` rounds
    them to even), so the export holds the bits the trained model computed with."""
    from ..optimizer.host_state import split_rounding, to_low

    split = dtype == torch.bfloat16 and split_rounding(opt.zero.placement)

    def cast(w: torch.Tensor) -> torch.Tensor:
        if w.dtype == dtype:
            return w
        out = torch.empty(w.shape, dtype=dtype)
        to_low(out, w, split)
        return out

    return cast


def export(model, opt, tokenizer, out_dir: str, dtype: torch.dtype) -> bool:
    """``save_pretrained`` of the model with its trainable weights from the fp32 master,
    cast to ``dtype``, and the tokenizer (collective; rank 0 writes). Tied weights stay
    tied: each key of the model's state dict that holds a trained parameter gets that
    parameter's one tensor. Returns whether this rank wrote."""
    full = opt.full_weights()
    if full is None:
        return False
    cast = _caster(opt, dtype)
    trained = {id(model.get_parameter(n)): cast(w) for n, w in full.items()}
    state = {}
    for key, value in model.state_dict(keep_vars=True).items():
        out = trained.get(id(value))
        if out is None:  # a buffer or a frozen parameter: as the model holds it
            out = value.detach().cpu()
            out = out.to(dtype) if out.is_floating_point() else out
        state[key] = out
    model.config.dtype = dtype
    model.save_pretrained(out_dir, state_dict=state)
    tokenizer.save_pretrained(out_dir)
    return True
