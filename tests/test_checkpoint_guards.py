"""Checkpoints: crash-safe saves, named load errors, and the guards around them (RNG
device, overwrite, writability, lock, manifest checksum, model shape)."""

import contextlib
import errno
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from dist_helpers import ckpt_run, log_losses, run_distributed
from helpers import CKPT_RUN, ROOT

from mp_offload import parallel_state as ps
from mp_offload.checkpoint import (
    CheckpointError,
    FullTensors,
    SaveLock,
    check_no_overwrite,
    check_writable,
    load_checkpoint,
    read_latest,
    save_checkpoint,
    write_checkpoint,
)
from mp_offload.config import parse_args, resolve
from mp_offload.model.gpt import GPTConfig, GPTModel
from mp_offload.optimizer import build_optimizer
from mp_offload.tensor_parallel import random as tp_random

pytestmark = pytest.mark.slow  # every test here spawns ranks


def test_killed_save_leaves_last_checkpoint_loadable(tmp_path):
    ck = str(tmp_path / "ckpt")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MP_OFFLOAD_CKPT_FAULT="before_rename:4",
        PYTHONWARNINGS="ignore",
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(ROOT, "pretrain_gpt.py"),
        *CKPT_RUN,
        "--save",
        ck,
        "--save-interval",
        "2",
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode != 0
    assert read_latest(ck) == 2
    # The killed job's lock stays behind (its pid is dead: the next job takes it over).
    assert sorted(os.listdir(ck)) == [
        ".lock",
        ".tmp_iter_0000004",
        "config.yaml",
        "iter_0000002",
        "latest_checkpointed_iteration.txt",
    ]
    log = str(tmp_path / "log.jsonl")
    ckpt_run(2, 1, "--load", ck, "--save", ck, "--train-iters", "3", "--log-json", log)
    assert sorted(log_losses(log)) == [3]
    assert read_latest(ck) == 3
    assert not os.path.exists(os.path.join(ck, ".tmp_iter_0000004")), "stale temp dir kept"
    assert not os.path.exists(os.path.join(ck, ".lock")), "lock not released at exit"


def _corrupt_worker(rank, world, ck):
    argv = CKPT_RUN + ["--tensor-model-parallel-size", "2"]
    ps.initialize_model_parallel(2)

    def attempt(extra=()):
        args = resolve(parse_args(argv + list(extra)), world)
        torch.manual_seed(0)
        model = GPTModel(args.model)
        opt = build_optimizer(model, args, torch.device("cpu"))
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(ck, model, opt, args)
        return str(err.value)

    it = os.path.join(ck, "iter_0000004")
    victim = os.path.join(it, "mp_rank_01", "optim_dp001.pt")
    with open(victim, "rb") as f:
        original = f.read()

    def overwrite(data: bytes) -> None:
        with open(victim, "wb") as f:
            f.write(data)

    torch.distributed.barrier()
    if rank == 0:
        overwrite(original[:-100])
    torch.distributed.barrier()
    msg = attempt()  # every rank raises, even those that never open the file
    assert "optim_dp001.pt" in msg and "truncated" in msg, msg
    if rank == 0:
        overwrite(original[:50] + bytes([original[50] ^ 1]) + original[51:])
    torch.distributed.barrier()
    msg = attempt()
    assert "optim_dp001.pt" in msg and "checksum" in msg, msg
    if rank == 0:
        os.remove(victim)
    torch.distributed.barrier()
    msg = attempt()
    assert "optim_dp001.pt" in msg and "missing" in msg, msg
    if rank == 0:
        overwrite(original)
    torch.distributed.barrier()
    msg = attempt(["--num-layers", "3"])
    assert "--num-layers is 3 here but 2 in the checkpoint" in msg, msg
    manifest_path = os.path.join(it, "manifest.json")
    with open(manifest_path) as f:
        saved_manifest = f.read()
    torch.distributed.barrier()
    if rank == 0:  # a hand edit: the TP size the slices are read with
        with open(manifest_path, "w") as f:
            f.write(
                saved_manifest.replace(
                    '"tensor_model_parallel_size": 2', '"tensor_model_parallel_size": 1'
                )
            )
    torch.distributed.barrier()
    msg = attempt()
    assert "manifest.json: does not match" in msg and "manifest.sha256" in msg, msg
    torch.distributed.barrier()
    if rank == 0:
        os.remove(manifest_path)
    torch.distributed.barrier()
    assert "manifest.json: missing" in attempt()


def test_corrupt_truncated_mismatched_checkpoints_are_refused(tmp_path):
    ck = str(tmp_path / "ckpt")
    ckpt_run(4, 2, "--save", ck, "--exit-interval", "4")
    run_distributed(_corrupt_worker, 4, ck)


# --------------------------------------------------------------- reliability guards
TINY = GPTConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=100,
    make_vocab_size_divisible_by=8,
)


def _tensor(name, key, shape, dim):
    g = torch.Generator().manual_seed(sum(map(ord, name + key)))
    return torch.randn(shape, generator=g) * 0.02


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _downgrade_to_v1(ckpt):
    """Make ``ckpt`` look as format version 1 wrote it: no manifest checksum, and RNG
    records that do not name their device."""
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    for rel, meta in manifest["files"].items():
        if "optim_dp" in rel:
            path = os.path.join(ckpt, rel)
            shard = torch.load(path, weights_only=True)
            del shard["rng"]["device"]
            torch.save(shard, path)
            meta.update(bytes=os.path.getsize(path), sha256=_sha(path))
    manifest["format_version"] = 1
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    os.remove(os.path.join(ckpt, "manifest.sha256"))


def test_edited_manifest_is_refused_and_version1_still_reads(tmp_path):
    ckpt = write_checkpoint(str(tmp_path / "ck"), 3, 24, TINY, 2, _tensor)
    full = FullTensors(ckpt)
    want = {n: full.get(n) for n in full.names}
    path = os.path.join(ckpt, "manifest.json")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:  # TP 2 -> 1: would read half of every split weight
        f.write(text.replace('"tensor_model_parallel_size": 2', '"tensor_model_parallel_size": 1'))
    with pytest.raises(CheckpointError, match=r"manifest\.json: does not match .*manifest\.sha256"):
        FullTensors(ckpt)
    with open(path, "w") as f:
        f.write(text)
    os.remove(os.path.join(ckpt, "manifest.sha256"))
    with pytest.raises(CheckpointError, match=r"manifest\.sha256: missing"):
        FullTensors(ckpt)
    ckpt = write_checkpoint(str(tmp_path / "v1"), 3, 24, TINY, 2, _tensor)
    _downgrade_to_v1(ckpt)
    full = FullTensors(ckpt)
    assert full.manifest["format_version"] == 1
    for n in full.names:
        assert torch.equal(full.get(n), want[n]), n
    with open(os.path.join(ckpt, "manifest.json")) as f:
        newer = json.load(f)
    newer["format_version"] = 99
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        json.dump(newer, f)
    with pytest.raises(
        CheckpointError,
        match=r"v1/iter_0000003/manifest\.json: format "
        r"version 99, this code reads 1, 2",
    ):
        FullTensors(ckpt)


class _FakeCuda:
    """A stand-in CUDA generator for the RNG tracker (no GPU here): 16-byte states like
    CUDA's Philox seed + offset, and torch's complaint when given a state of another size."""

    def __init__(self):
        self.state = torch.zeros(16, dtype=torch.uint8)

    def manual_seed(self, seed):
        self.state = torch.tensor(
            list(int(seed).to_bytes(8, "little")) + [0] * 8, dtype=torch.uint8
        )

    def get(self, device):
        return self.state.clone() if device == "cuda" else torch.get_rng_state()

    def set(self, state, device):
        if device != "cuda":
            return torch.set_rng_state(state)
        if state.numel() != 16:
            raise RuntimeError("RNG state is wrong size")
        self.state = state.clone()

    @contextlib.contextmanager
    def installed(self):
        saved = (tp_random.get_rng_state, tp_random.set_rng_state, torch.cuda.manual_seed)
        tp_random.get_rng_state, tp_random.set_rng_state = self.get, self.set
        torch.cuda.manual_seed = self.manual_seed
        try:
            yield
        finally:
            tp_random.get_rng_state, tp_random.set_rng_state, torch.cuda.manual_seed = saved


def _rng_worker(rank, world, root):
    args = resolve(parse_args(CKPT_RUN), 1)
    ps.initialize_model_parallel(1)
    seed, tracker, fake = args.train.seed, tp_random.get_rng_tracker(), _FakeCuda()
    torch.manual_seed(0)
    model = GPTModel(args.model)
    opt = build_optimizer(model, args, torch.device("cpu"))

    def fresh(device):
        """Seed as a run on ``device`` does; returns (tracker states, default state)."""
        tp_random.model_parallel_seed(seed, 0, device)
        return tracker.get_states(), torch.get_rng_state()

    def save(path, device):
        """Save with RNG streams that differ from a fresh seeding; returns them."""
        fresh(device)
        with tracker.fork():
            torch.rand(7)
        torch.rand(3)
        states = (tracker.get_states(), torch.get_rng_state())
        save_checkpoint(path, 1, 8, model, opt, args)
        return states

    def load(path, device):
        fresh(device)
        torch.rand(5)  # disturb: a reseed or a restore must show
        logs = []
        load_checkpoint(path, model, opt, args, log=logs.append)
        with tracker.fork():  # what the first dropout of the resumed run does
            pass
        return logs

    def now_is(want):
        states, default = tracker.get_states(), torch.get_rng_state()
        return (
            states.keys() == want[0].keys()
            and torch.equal(default, want[1])
            and all(torch.equal(states[k], want[0][k]) for k in states)
        )

    save(f"{root}/cpu", "cpu")
    with fake.installed():
        want = fresh("cuda")
        logs = load(f"{root}/cpu", "cuda")  # before the fix: "RNG state is wrong size"
        assert tracker.device == "cuda" and now_is(want)  # reseeded as a fresh run
    assert len(logs) == 1 and "saved on cpu, this run is on cuda: reseeded" in logs[0], logs
    with fake.installed():
        save(f"{root}/cuda", "cuda")
    want = fresh("cpu")
    logs = load(f"{root}/cuda", "cpu")  # before the fix: torch's "RNG state is wrong size"
    assert len(logs) == 1 and "saved on cuda, this run is on cpu" in logs[0], logs
    assert tracker.device == "cpu" and now_is(want)
    # A version-1 file (no device recorded) on the same device resumes its streams exactly.
    saved = save(f"{root}/v1", "cpu")
    _downgrade_to_v1(f"{root}/v1/iter_0000001")
    fresh("cpu")
    torch.rand(5)
    logs = []
    load_checkpoint(f"{root}/v1", model, opt, args, log=logs.append)
    assert logs == [] and now_is(saved)


def test_rng_saved_on_another_device_type_is_reseeded(tmp_path):
    run_distributed(_rng_worker, 1, str(tmp_path))


def _two_iterations(root):
    """A checkpoint root holding iterations 3 and 6 (latest 6)."""
    write_checkpoint(str(root), 3, 24, TINY, 1, _tensor)
    shutil.copytree(os.path.join(root, "iter_0000003"), os.path.join(root, "iter_0000006"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("6")
    return str(root)


def _snapshot(root):
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            if not n.startswith(".lock"):
                out[os.path.relpath(os.path.join(d, n), root)] = _sha(os.path.join(d, n))
    return out


def test_overwrite_guard_cases(tmp_path):
    root = _two_iterations(tmp_path / "ck")
    other = write_checkpoint(str(tmp_path / "other"), 6, 48, TINY, 1, _tensor)
    check_no_overwrite(root, root)  # resumes the newest: continues it
    check_no_overwrite(root, os.path.join(root, "iter_0000006") + "/")
    check_no_overwrite(root, str(tmp_path / "typo"), override=True)
    check_no_overwrite(str(tmp_path / "fresh"), str(tmp_path / "typo"))  # nothing to lose
    refused = [
        (str(tmp_path / "typo"), {}, "holds no checkpoint"),
        (None, {}, "no --load"),
        (os.path.join(root, "iter_0000003"), {}, "resumes iteration 3"),
        (root, {"finetune": True}, "--finetune restarts at iteration 0"),
        (other, {}, "is another directory"),
    ]
    for load, kw, why in refused:
        with pytest.raises(CheckpointError) as err:
            check_no_overwrite(root, load, **kw)
        msg = str(err.value)
        assert f"--save {root} already holds checkpoints (iterations 3, 6)" in msg, msg
        assert why in msg and "--override-existing-checkpoints" in msg and "\n" not in msg


def test_save_must_be_a_writable_directory(tmp_path, monkeypatch):
    path = tmp_path / "afile"
    path.write_text("x")
    with pytest.raises(CheckpointError, match="afile: is a file, not a directory"):
        check_writable(str(path))
    check_writable(str(tmp_path / "new" / "dir"))  # created
    assert os.listdir(tmp_path / "new" / "dir") == []  # the probe is gone
    ro, real_open = tmp_path / "ro", os.open
    ro.mkdir()

    def read_only(p, *a, **kw):  # chmod does not stop root: refuse as a read-only fs would
        if str(p).startswith(str(ro)):
            raise OSError(errno.EROFS, "Read-only file system", str(p))
        return real_open(p, *a, **kw)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(CheckpointError, match=r"ro: not writable \(Read-only file system\)"):
        check_writable(str(ro))


_HOLD = (
    "import sys, time\nfrom mp_offload.checkpoint import SaveLock\n"
    "SaveLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\ntime.sleep(300)\n"
)


@contextlib.contextmanager
def _held_lock(root):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, root], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_save_lock_refuses_a_second_job_and_takes_over_a_dead_ones(tmp_path):
    root = str(tmp_path / "ck")
    os.makedirs(root)
    with _held_lock(root) as holder:
        with pytest.raises(CheckpointError) as err:
            SaveLock(root).acquire()
        msg = str(err.value)
        assert f"host {socket.gethostname()}, pid {holder.pid}" in msg, msg
        assert "in use by another job" in msg
    lock = SaveLock(root)  # the holder was killed without releasing: stale, taken over
    lock.acquire()
    with pytest.raises(CheckpointError, match=f"pid {os.getpid()}"):
        SaveLock(root).acquire()  # held by a live process (this one)
    lock.release()
    assert os.listdir(root) == []


@pytest.mark.parametrize("case", ["misspelled_load", "older_iteration", "save_is_a_file", "locked"])
def test_bad_save_setup_stops_every_rank_before_training(tmp_path, case):
    root = _two_iterations(tmp_path / "ck")
    before = _snapshot(root)
    afile = tmp_path / "afile"
    afile.write_text("x")
    flags, expect = {
        "misspelled_load": (
            ["--load", str(tmp_path / "ckk"), "--save", root],
            "already holds checkpoints (iterations 3, 6)",
        ),
        "older_iteration": (
            ["--load", os.path.join(root, "iter_0000003"), "--save", root],
            "resumes iteration 3",
        ),
        "save_is_a_file": (["--save", str(afile)], "is a file, not a directory"),
        "locked": (["--load", root, "--save", root], "in use by another job"),
    }[case]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(ROOT, "pretrain_gpt.py"),
        *CKPT_RUN,
        "--save-interval",
        "1",
        *flags,
    ]
    with _held_lock(root) if case == "locked" else contextlib.nullcontext():
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    errors = [
        line for line in res.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")
    ]
    assert res.returncode != 0
    # printed once for the job, as its first line (distributed.fail)
    assert len(errors) == 1 and res.stderr.startswith(errors[0]), res.stderr[-3000:]
    assert expect in errors[0] and str(tmp_path) in errors[0], errors[0]
    assert _snapshot(root) == before, "a checkpoint was touched"
    assert read_latest(root) == 6


def test_model_shape_check_names_a_different_norm_epsilon():
    """A norm epsilon other than the checkpoint's is a different model: refused, named."""
    import dataclasses

    from mp_offload.checkpoint.on_disk import check_model_shape
    from mp_offload.model.gpt import GPTConfig

    saved = GPTConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=128,
        max_position_embeddings=32,
        layernorm_epsilon=1e-6,
    )
    manifest = {"model_config": dataclasses.asdict(saved)}
    check_model_shape(manifest, "ckpt", saved)  # the same model passes
    here = dataclasses.replace(saved, layernorm_epsilon=1e-5)
    with pytest.raises(CheckpointError, match="--layernorm-epsilon is 1e-05 here but 1e-06"):
        check_model_shape(manifest, "ckpt", here)
    # A checkpoint written before the field existed means the default (1e-5).
    old = {
        "model_config": {
            k: v for k, v in manifest["model_config"].items() if k != "layernorm_epsilon"
        }
    }
    check_model_shape(old, "ckpt", here)


# ------------------------------------------------------------- nothing non-finite saved
def test_all_finite_finds_any_inf_or_nan_in_any_dtype():
    from mp_offload.checkpoint.save import all_finite

    ok = [torch.zeros(0), torch.randn(1000), torch.ones(7, dtype=torch.bfloat16)]
    assert all_finite(ok) and all_finite([])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for bad in (float("nan"), float("inf"), -float("inf")):
            t = torch.randn(10_007).to(dtype)
            t[5003] = bad
            assert not all_finite([*ok, t]), (dtype, bad)


def _non_finite_master_worker(rank, world, root):
    """DP=2: rank 1's fp32 master holds a NaN. Both ranks refuse the save with the same
    line naming rank 1; iteration 1 stays the latest, nothing else is left."""
    from mp_offload.checkpoint.save import NonFiniteStateError

    args = resolve(parse_args(CKPT_RUN), world)
    ps.initialize_model_parallel(1)
    torch.manual_seed(0)
    model = GPTModel(args.model)
    opt = build_optimizer(model, args, torch.device("cpu"))
    save_checkpoint(root, 1, 8, model, opt, args, keep=1)
    if rank == 1:
        master = opt.state_dict()["master"]  # the live slice
        (master if isinstance(master, torch.Tensor) else master[-1])[3] = float("nan")
    with pytest.raises(NonFiniteStateError) as e:
        save_checkpoint(root, 2, 16, model, opt, args, keep=1)
    assert str(e.value) == (
        "the checkpoint of iteration 2 was not saved: the fp32 master weights (TP rank 0, "
        "DP rank 1) hold inf or NaN, the run diverged in its last steps; iteration 1 stays "
        f"the latest checkpoint in --save {root} (lower --lr, check the data, or use --bf16)"
    )
    torch.distributed.barrier()
    assert read_latest(root) == 1
    assert sorted(n for n in os.listdir(root) if n != "iter_0000001") == [
        "latest_checkpointed_iteration.txt"
    ]


@pytest.mark.slow
def test_a_non_finite_master_on_one_rank_stops_the_save_on_every_rank(tmp_path):
    run_distributed(_non_finite_master_worker, 2, str(tmp_path / "ck"))
