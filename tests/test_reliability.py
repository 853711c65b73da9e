"""Bad input and faults end as one named line, never a hang, a traceback or silent training.

One test per promise of docs/RELIABILITY.md (the flag checks are in test_config.py, the
torchrun output in test_pretrain_cli.py, preprocessing in test_preprocess.py, ranks that
wait, stall or lose their launcher in test_reliability_ranks.py);
``python tools/reliability_probe.py`` runs the full table of cases.
"""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from dist_helpers import run_distributed
from helpers import ROOT
from pretrain_runs import (
    ERROR,
    PRETRAIN,
    TINY,
    assert_one_line,
    pretrain_env,
    run_pretrain,
    snapshot,
)

from mp_offload.config import ConfigError, parse_args, resolve
from mp_offload.data.checks import check_token_ids, token_range
from mp_offload.data.preprocess import preprocess
from mp_offload.preflight import check_inputs


@pytest.fixture(scope="module")
def wide_ids(tmp_path_factory):
    """A dataset made with a 1000-id NullTokenizer: ids far beyond the tiny model's 97."""
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    with open(d / "docs.jsonl", "w") as f:
        for _ in range(60):
            f.write(json.dumps({"text": " ".join(map(str, rng.integers(0, 1000, 40)))}) + "\n")
    preprocess(
        [str(d / "docs.jsonl")],
        str(d / "wide"),
        "NullTokenizer",
        vocab_size=1000,
        append_eod=True,
        log=io.StringIO(),
    )
    return str(d / "wide_text_document")


# ------------------------------------------------------------ 1. checked before start-up
def test_input_files_are_checked_before_start(wide_ids, tmp_path):
    """Every problem of the files is one line naming the flag and the fix (no process
    group needed); the tokenizer is loaded once, here."""
    os.makedirs(tmp_path / "d")
    with open(tmp_path / "half.bin", "wb"):
        pass
    argv = [
        "--train-iters",
        "2",
        "--tokenizer-type",
        "NullTokenizer",
        "--data-path",
        "1",
        f"{wide_ids}.bin",
        "1",
        str(tmp_path / "d"),
        "1",
        wide_ids[:-9],
        "1",
        str(tmp_path / "half"),
        "--log-json",
        str(tmp_path / "half.bin" / "log.jsonl"),
    ]
    args = resolve(parse_args(argv), 1)
    with pytest.raises(ConfigError) as e:
        check_inputs(args)
    lines = str(e.value).splitlines()
    assert lines == [
        f"--log-json {tmp_path}/half.bin/log.jsonl: {tmp_path}/half.bin is a file, not a directory",
        f"--data-path {wide_ids}.bin: give the prefix {wide_ids} (without .bin)",
        f"--data-path {tmp_path}/d: is a directory; give the prefix of a .bin/.idx pair; "
        f"it holds no .idx files",
        f"--data-path {wide_ids[:-9]}: no {wide_ids[:-9]}.bin or {wide_ids[:-9]}.idx "
        f"(tools/preprocess_data.py writes them): did you mean {wide_ids}?",
        f"--data-path {tmp_path}/half: {tmp_path}/half.idx is missing (the .bin and .idx of "
        f"tools/preprocess_data.py belong together)",
    ], lines
    args.data.data_path, args.log.log_json = [wide_ids], None
    assert check_inputs(args).vocab_size == 4097  # NullTokenizer: --vocab-size, plus EOD
    args.data.tokenizer_type, args.data.tokenizer_model = "SentencePieceTokenizer", "nope.model"
    with pytest.raises(ConfigError, match="^--tokenizer-model nope.model: no such file$"):
        check_inputs(args)
    with open(f"{wide_ids}.idx", "rb") as f:
        head = f.read(40)
    with open(tmp_path / "cut.idx", "wb") as f:
        f.write(head)
    os.link(f"{wide_ids}.bin", tmp_path / "cut.bin")
    args.data.tokenizer_type, args.data.data_path = "NullTokenizer", [str(tmp_path / "cut")]
    with pytest.raises(ConfigError, match="cut.idx: truncated or corrupt index"):
        check_inputs(args)


# ------------------------------------------------------------------ 3. fp16 divergence
@pytest.mark.slow
def test_fp16_divergence_stops_before_saving(tmp_path):
    """Every step overflows (a loss scale fp16 cannot hold): the run stops with the reason
    after --max-consecutive-skipped-steps and saves no checkpoint of the diverged run."""
    res = run_pretrain(
        *TINY,
        "--mock-data",
        "--train-iters",
        "8",
        "--fp16",
        "--initial-loss-scale",
        "1e30",
        "--min-loss-scale",
        "1e30",
        "--max-consecutive-skipped-steps",
        "3",
        "--save",
        str(tmp_path / "ck"),
    )
    assert_one_line(
        res, "3 consecutive steps skipped for fp16 gradient overflow (iterations 1-3", code=1
    )
    assert not os.path.exists(tmp_path / "ck" / "latest_checkpointed_iteration.txt")


def _iterations(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("iter_"))


def _finite_checkpoint(ckpt) -> bool:
    """Every tensor of every file of an iteration directory is finite."""
    import torch

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from tensors(v)

    files = [os.path.join(w, n) for w, _, ns in os.walk(ckpt) for n in ns if n.endswith(".pt")]
    assert files, ckpt
    return all(
        bool(t.isfinite().all())
        for f in files
        for t in tensors(torch.load(f, weights_only=True))
        if t.is_floating_point()
    )


@pytest.mark.slow
def test_a_diverged_fp16_step_is_never_published_and_the_good_checkpoint_resumes(tmp_path):
    """--save-interval 1 --keep-checkpoints 1: iteration 3 is good; resumed with a huge
    --lr, the step of iteration 4 blows the fp16 weights up while its loss (computed
    before the step) is still finite. That save is refused before it is published or
    rotates 3 out: every checkpoint left is finite, 3 is the latest, byte for byte as
    it was, and resumes to the same weights as a run that never broke."""
    from mp_offload.checkpoint.on_disk import iter_dir, model_file

    d, unbroken = str(tmp_path / "ck"), str(tmp_path / "unbroken")
    fp16 = [*TINY, "--mock-data", "--fp16", "--save-interval", "1", "--train-iters", "5"]
    res = run_pretrain(*fp16, "--keep-checkpoints", "1", "--save", d, "--exit-interval", "3")
    assert res.returncode == 0, res.stderr[-3000:]
    good = snapshot(iter_dir(d, 3))
    res = run_pretrain(*fp16, "--keep-checkpoints", "1", "--save", d, "--load", d, "--lr", "1e10")
    assert_one_line(
        res,
        "the checkpoint of iteration 4 was not saved: the weights (TP rank 0, DP rank 0) "
        f"hold inf or NaN, the run diverged in its last steps; iteration 3 stays the latest "
        f"checkpoint in --save {d}",
        code=1,
    )
    assert _iterations(d) == ["iter_0000003"] and not [
        n for n in os.listdir(d) if n.startswith(".tmp")
    ]
    with open(os.path.join(d, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "3"
    assert snapshot(iter_dir(d, 3)) == good and _finite_checkpoint(iter_dir(d, 3))
    assert run_pretrain(*fp16, "--save", d, "--load", d).returncode == 0
    assert run_pretrain(*fp16, "--save", unbroken).returncode == 0
    import torch

    resumed, want = (
        torch.load(os.path.join(iter_dir(r, 5), model_file(0)), weights_only=True)
        for r in (d, unbroken)
    )
    assert all(torch.equal(resumed[k], want[k]) for k in want)


@pytest.mark.slow
def test_checkpoints_during_skipped_fp16_steps_spare_the_last_one_before_them(tmp_path):
    """--keep-checkpoints 2 while every step overflows: the checkpoints taken during the
    run of skipped steps never rotate out the last one taken before it."""
    skip = str(tmp_path / "skip")
    fp16 = [*TINY, "--mock-data", "--fp16", "--save-interval", "1", "--keep-checkpoints", "2"]
    assert run_pretrain(*fp16, "--save", skip, "--train-iters", "3").returncode == 0
    every_step_overflows = ["--initial-loss-scale", "1e30", "--min-loss-scale", "1e30"]
    res = run_pretrain(
        *fp16, "--save", skip, "--load", skip, "--train-iters", "20", "--no-load-optim",
        *every_step_overflows, "--max-consecutive-skipped-steps", "4",
    )  # fmt: skip
    assert_one_line(res, "4 consecutive steps skipped", code=1)
    assert _iterations(skip) == ["iter_0000003", "iter_0000005", "iter_0000006"]


@pytest.mark.slow
def test_an_fp16_run_that_skipped_every_step_is_an_error(tmp_path):
    res = run_pretrain(
        *TINY, "--mock-data", "--fp16", "--train-iters", "5", "--initial-loss-scale", "1e30",
        "--min-loss-scale", "1e30",
    )  # fmt: skip
    assert_one_line(
        res, "5 of the 5 steps of this run (iterations 1-5) were skipped for fp16", code=1
    )


# ------------------------------------------------------ 4. ids beyond the vocabulary
def test_token_range_is_cached_by_size_and_mtime(wide_ids, tmp_path):
    lo, hi = token_range(wide_ids, str(tmp_path))
    assert lo >= 0 and hi == 1000  # the EOD of a 1000-id NullTokenizer
    cache = tmp_path / f"{os.path.basename(wide_ids)}_token_range.json"
    rec = json.loads(cache.read_text())
    cache.write_text(json.dumps(dict(rec, max_id=7)))
    assert token_range(wide_ids, str(tmp_path)) == (lo, 7)  # read from the cache
    os.utime(f"{wide_ids}.bin", ns=(rec["bin_mtime_ns"] + 10**9,) * 2)
    assert token_range(wide_ids, str(tmp_path)) == (lo, hi)  # a changed file is read again


def test_a_tampered_index_cache_is_rebuilt_naming_the_file(wide_ids, tmp_path, capsys):
    from mp_offload.data.gpt_dataset import build_train_valid_test_datasets

    def build():
        return build_train_valid_test_datasets(
            [wide_ids], "1,0,0", [40, 0, 0], 16, 1, str(tmp_path)
        )[0]

    want = [build()[i]["text"].tolist() for i in range(40)]
    (sample,) = [p for p in os.listdir(tmp_path) if p.endswith("_sample_idx.npy")]
    arr = np.load(tmp_path / sample)
    arr[3, 0] = 10**6  # a position far beyond the document stream
    np.save(tmp_path / sample, arr)
    ds = build()
    assert [ds[i]["text"].tolist() for i in range(40)] == want
    assert (
        f"{tmp_path}/{sample}: values outside [0,"
        in capsys.readouterr().out + capsys.readouterr().err
    )


def test_null_tokenizer_on_data_of_another_tokenizer_warns(wide_ids):
    # wide_ids: NullTokenizer --vocab-size 1000 (EOD 1000); read as --vocab-size 4096
    (line,) = check_token_ids(
        [wide_ids], 4097, "--tokenizer-type NullTokenizer --vocab-size 4096", null_eod=4096
    )
    assert "its largest token id is 1000, not 4096" in line and "--vocab-size 1000" in line
    assert check_token_ids([wide_ids], 1001, "NullTokenizer 1000", null_eod=1000) == []


@pytest.mark.slow
def test_token_ids_beyond_the_vocabulary_are_refused(wide_ids, tmp_path):
    """Data made with a bigger tokenizer: refused at start-up naming the file and both
    numbers (before: an IndexError traceback at TP=1, silent zero embeddings at TP=2)."""
    res = run_pretrain(
        *TINY,
        "--tokenizer-type",
        "NullTokenizer",
        "--data-path",
        wide_ids,
        "--train-iters",
        "2",
        "--data-cache-dir",
        str(tmp_path),
    )
    assert_one_line(
        res,
        f"{wide_ids}.bin: token id 1000 is outside the vocabulary of 97 ids "
        f"of --tokenizer-type NullTokenizer --vocab-size 96",
        code=2,
    )


# ------------------------------------------------------------ full disk, stale locks
def test_an_empty_or_dead_lock_is_taken_over_with_a_line(tmp_path):
    from mp_offload.checkpoint import SaveLock

    (tmp_path / ".lock").write_text("")  # a job died between creating and writing it
    lines = []
    lock = SaveLock(str(tmp_path))
    lock.acquire(lines.append)
    assert lines == [
        f"took over the stale lock {tmp_path}/.lock left empty by a job that died while taking it"
    ]
    lock.release()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = json.loads(json.dumps(SaveLock(str(tmp_path)).record))["host"]
    (tmp_path / ".lock").write_text(json.dumps({"host": host, "pid": dead.pid, "started": None}))
    lines.clear()
    SaveLock(str(tmp_path)).acquire(lines.append)
    assert lines == [
        f"took over the stale lock {tmp_path}/.lock of pid {dead.pid} (not alive on {host})"
    ]


@pytest.mark.slow
def test_a_full_disk_mid_save_is_one_line_and_leaves_no_partial_save(tmp_path):
    res = run_pretrain(
        *TINY, "--mock-data", "--train-iters", "2", "--save", str(tmp_path),
        MP_OFFLOAD_CKPT_ENOSPC="before_manifest",
    )  # fmt: skip
    assert_one_line(
        res,
        f"--save {tmp_path}: the checkpoint of iteration 2 could not be written (No space "
        f"left on device; ",
        code=1,
    )
    assert "MiB free); its partial directory" in res.stderr
    assert sorted(os.listdir(tmp_path)) == ["config.yaml"], os.listdir(tmp_path)


@pytest.mark.slow
def test_a_file_size_limit_under_torchrun_is_one_line_on_every_rank(tmp_path):
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [PRETRAIN, *TINY, "--mock-data", "--train-iters", "2", "--save", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=200,
        env=pretrain_env(),
        cwd=ROOT,
        preexec_fn=limit,
    )
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith(ERROR)]
    assert res.returncode != 0 and len(errors) == 1, (res.returncode, res.stderr[-3000:])
    assert "File too large, the file-size limit (ulimit -f);" in errors[0], errors[0]
    assert "[rank" not in res.stderr and "mp_offload/" not in res.stderr, res.stderr[-3000:]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp_iter_")]


# ------------------------------------------------ 7. a data error on one rank, and tools
def _data_error_worker(rank, world, prefix, out_dir):
    from mp_offload import parallel_state as ps
    from mp_offload.data import gpt_dataset
    from mp_offload.data.build import build_datasets
    from mp_offload.runtime.distributed import StartupError

    if rank == 1:  # only this rank's disk is full

        def full(*args, **kwargs):
            raise OSError(28, "No space left on device", "/cache/train_doc_idx.npy")

        gpt_dataset.build_train_valid_test_datasets = full
    args = resolve(
        parse_args(
            TINY
            + [
                "--train-iters",
                "2",
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "1000",
                "--data-path",
                prefix,
                "--data-cache-dir",
                out_dir,
            ]
        ),
        world,
    )
    ps.initialize_model_parallel(1)
    try:
        build_datasets(args)
    except StartupError as e:
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(str(e))


@pytest.mark.slow
def test_a_data_error_on_one_rank_reaches_every_rank(wide_ids, tmp_path):
    """Not one rank's traceback while the others wait or lose the connection: every rank
    raises the same one-line error, naming the rank that had it."""
    run_distributed(_data_error_worker, 2, wide_ids, str(tmp_path))
    want = "rank 1: [Errno 28] No space left on device: '/cache/train_doc_idx.npy'"
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == [want, want]


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--top-p", "0"], "--top-p must be > 0 and <= 1, got 0"),
        (["--top-p", "1.5"], "--top-p must be > 0 and <= 1, got 1.5"),
        (["--top-k", "-1"], "--top-k must be >= 0 (0: no limit), got -1"),
        (["--temperature", "0"], "--temperature must be > 0, got 0"),
        (["--max-new-tokens", "-3"], "--max-new-tokens must be >= 0, got -3"),
    ],
)
def test_generate_rejects_bad_sampling_flags(flags, needle, tmp_path):
    from mp_offload.generation import main

    with pytest.raises(SystemExit) as e:  # before any checkpoint is read
        main(["--load", str(tmp_path / "none"), *flags])
    assert str(e.value).startswith(f"generate: {needle}"), str(e.value)
