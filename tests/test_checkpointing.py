"""Checkpoints: exact resume, resharding, crash-safe saves, named load errors."""
import json
import os
import subprocess
import sys

import pytest
import torch
from dist_helpers import run_distributed

from mp_offload import parallel_state as ps
from mp_offload.checkpointing import CheckpointError, load_checkpoint, read_latest
from mp_offload.config import parse_args, validate
from mp_offload.model.gpt import GPTModel
from mp_offload.optimizer import build_optimizer
from mp_offload.training import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "100", "--make-vocab-size-divisible-by", "8",
        "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "3e-3",
        "--lr-warmup-iters", "2", "--train-iters", "8", "--eval-interval", "3",
        "--eval-iters", "1", "--log-interval", "100", "--cpu-offload",
        "--reduce-bucket-size", "3000"]


def _pretrain_worker(rank, world, argv):
    pretrain(argv)


def run(world, tp, *extra):
    run_distributed(_pretrain_worker, world,
                    BASE + ["--tensor-model-parallel-size", str(tp), *extra])


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def losses(path):
    return {r["iteration"]: r["loss"] for r in records(path) if "loss" in r}


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """8 iterations at TP=2 x DP=2 without a break, fp32 and bf16."""
    d = tmp_path_factory.mktemp("unbroken")
    for dtype in ("fp32", "bf16"):
        flags = ["--bf16"] if dtype == "bf16" else []
        run(4, 2, "--log-json", str(d / f"{dtype}.jsonl"), *flags)
    return d


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_exact_resume_tp2_dp2_offload(unbroken, tmp_path, dtype):
    flags = ["--bf16"] if dtype == "bf16" else []
    log = str(tmp_path / "log.jsonl")
    ck = str(tmp_path / "ckpt")
    run(4, 2, "--save", ck, "--exit-interval", "4", "--log-json", log, *flags)
    assert read_latest(ck) == 4
    run(4, 2, "--load", ck, "--save", ck, "--log-json", log, *flags)
    # Bitwise: losses, grad norms, lr and validation losses, iteration by iteration.
    drop = ("elapsed_ms", "tokens_per_sec", "tflops_per_device", "peak_device_gb",
            "peak_host_gb", "host_device_bytes_per_param")
    clean = lambda rs: [{k: v for k, v in r.items() if k not in drop} for r in rs]  # noqa
    got, want = clean(records(log)), clean(records(unbroken / f"{dtype}.jsonl"))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a == b, (a, b)


@pytest.mark.parametrize("save_layout,load_layout", [((2, 4), (1, 4)), ((2, 4), (1, 1)),
                                                     ((1, 2), (2, 2))])
def test_reshard_continues_like_unbroken(unbroken, tmp_path, save_layout, load_layout):
    """(TP, world): (2,2)->(1,4), (2,2)->(1,1), (1,2)->(2,1)."""
    (tp_a, w_a), (tp_b, w_b) = save_layout, load_layout
    ck = str(tmp_path / "ckpt")
    run(w_a, tp_a, "--save", ck, "--exit-interval", "4")
    log = str(tmp_path / "log.jsonl")
    run(w_b, tp_b, "--load", ck, "--log-json", log)
    want, got = losses(unbroken / "fp32.jsonl"), losses(log)
    assert sorted(got) == [5, 6, 7, 8]
    for it in got:  # fp32; only reduction order differs between layouts
        assert abs(got[it] - want[it]) <= 1e-4 * want[it], (it, got[it], want[it])


def test_killed_save_leaves_last_checkpoint_loadable(tmp_path):
    ck = str(tmp_path / "ckpt")
    env = dict(os.environ, OMP_NUM_THREADS="1", MP_OFFLOAD_CKPT_FAULT="before_rename:4",
               PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(ROOT, "pretrain_gpt.py"), *BASE, "--save", ck, "--save-interval", "2"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode != 0
    assert read_latest(ck) == 2
    assert sorted(os.listdir(ck)) == [".tmp_iter_0000004", "config.yaml", "iter_0000002",
                                      "latest_checkpointed_iteration.txt"]
    log = str(tmp_path / "log.jsonl")
    run(2, 1, "--load", ck, "--save", ck, "--train-iters", "3", "--log-json", log)
    assert sorted(losses(log)) == [3]
    assert read_latest(ck) == 3
    assert not os.path.exists(os.path.join(ck, ".tmp_iter_0000004")), "stale temp dir kept"


def _corrupt_worker(rank, world, ck):
    argv = BASE + ["--tensor-model-parallel-size", "2"]
    ps.initialize_model_parallel(2)

    def attempt(extra=()):
        args = parse_args(argv + list(extra))
        validate(args, world)
        torch.manual_seed(0)
        model = GPTModel(args.model)
        opt = build_optimizer(model, args, torch.device("cpu"))
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(ck, model, opt, args)
        return str(err.value)

    it = os.path.join(ck, "iter_0000004")
    victim = os.path.join(it, "mp_rank_01", "optim_dp001.pt")
    original = open(victim, "rb").read()
    torch.distributed.barrier()
    if rank == 0:
        open(victim, "wb").write(original[:-100])
    torch.distributed.barrier()
    msg = attempt()  # every rank raises, even those that never open the file
    assert "optim_dp001.pt" in msg and "truncated" in msg, msg
    if rank == 0:
        open(victim, "wb").write(original[:50] + bytes([original[50] ^ 1]) + original[51:])
    torch.distributed.barrier()
    msg = attempt()
    assert "optim_dp001.pt" in msg and "checksum" in msg, msg
    if rank == 0:
        os.remove(victim)
    torch.distributed.barrier()
    msg = attempt()
    assert "optim_dp001.pt" in msg and "missing" in msg, msg
    if rank == 0:
        open(victim, "wb").write(original)
    torch.distributed.barrier()
    msg = attempt(["--num-layers", "3"])
    assert "--num-layers is 3 here but 2 in the checkpoint" in msg, msg
    torch.distributed.barrier()
    if rank == 0:
        os.remove(os.path.join(it, "manifest.json"))
    torch.distributed.barrier()
    assert "manifest.json: missing" in attempt()


def test_corrupt_truncated_mismatched_checkpoints_are_refused(tmp_path):
    ck = str(tmp_path / "ckpt")
    run(4, 2, "--save", ck, "--exit-interval", "4")
    run_distributed(_corrupt_worker, 4, ck)
