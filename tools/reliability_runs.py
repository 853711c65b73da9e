"""The machinery of tools/reliability_probe.py: the Case record, the commands (pretrain_gpt.py
alone or under torchrun, the tools), the tiny inputs every case runs on (built once in a
temporary directory, ``$D`` in the commands), and the runners of the cases that need more
than one command (a held lock, a killed launcher, a port in use).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from mp_offload.runtime.distributed import without_launcher  # noqa: E402 (after the path)

PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")
MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--log-interval",
    "1",
    "--eval-interval",
    "1000",
    "--eval-iters",
    "1",
]
TINY = MODEL + ["--mock-data", "--vocab-size", "96", "--train-iters", "2"]
DATA = MODEL + ["--train-iters", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96"]


@dataclass
class Case:
    area: str
    name: str
    cmd: list  # argv; "$D" stands for the fixture directory
    needle: str = ""  # words the error line (or, for "ok", the output) must hold
    code: int = 2  # the exit code of the failing process (torchrun: its root cause)
    expect: str = "error"
    prefix: str = "pretrain_gpt.py: error: "
    lines: int = 1  # error lines due (one per problem)
    first: bool = True  # the error must be the first line on stderr
    env: dict = field(default_factory=dict)
    timeout: float = 180.0
    runner: object = None  # a function(case, d) -> (rc, out, err, problem) for the odd ones
    check: object = None  # a function(d, rc, out, err) -> problem or None, after the run


def pretrain(*args) -> list:
    return [sys.executable, PRETRAIN, *args]


def torchrun(n: int, *args) -> list:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        PRETRAIN,
        *args,
    ]


def tool(name: str, *args) -> list:
    return [sys.executable, os.path.join(ROOT, "tools", f"{name}.py"), *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(extra: dict) -> dict:
    env = without_launcher(os.environ)
    return dict(
        env,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        MP_OFFLOAD_DEVICE="cpu",
        PYTHONPATH=ROOT,
        **extra,
    )


def expand(cmd: list, d: str) -> list:
    return [a.replace("$D", d) for a in cmd]


# ------------------------------------------------------------------------ fixtures
def build_fixtures(d: str) -> None:
    """Tiny datasets and tokenizers under ``d`` (a few seconds)."""
    import numpy as np

    from mp_offload.data.indexed_dataset import IndexedDatasetBuilder
    from mp_offload.data.preprocess import preprocess
    from mp_offload.data.tokenizer_training import train_sentencepiece

    rng = np.random.default_rng(0)
    for name, vocab in (("small", 96), ("wide", 1000)):
        with open(f"{d}/{name}.jsonl", "w") as f:
            for _ in range(80):
                ids = rng.integers(0, min(vocab, 90) if name == "small" else vocab, 40)
                f.write(json.dumps({"text": " ".join(map(str, ids))}) + "\n")
        preprocess(
            [f"{d}/{name}.jsonl"],
            f"{d}/{name}",
            "NullTokenizer",
            vocab_size=vocab,
            append_eod=True,
            log=io.StringIO(),
        )
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    docs = [" ".join(words[(i * 7 + k * 3) % 10] for k in range(50)) for i in range(200)]
    with open(f"{d}/words.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in docs)
    train_sentencepiece(docs, f"{d}/sp", 300)
    preprocess(
        [f"{d}/words.jsonl"],
        f"{d}/words",
        "SentencePieceTokenizer",
        tokenizer_model=f"{d}/sp.model",
        append_eod=True,
        log=io.StringIO(),
    )
    small = f"{d}/small_text_document"
    for suffix in (".bin", ".idx"):  # half pairs
        shutil.copy(small + suffix, f"{d}/only{suffix}")
    os.remove(f"{d}/only.bin")
    shutil.copy(f"{small}.bin", f"{d}/onlybin.bin")
    _damaged_copies(d, small)
    builder = IndexedDatasetBuilder(f"{d}/empty.bin", np.uint16)
    builder.finalize(f"{d}/empty.idx")
    os.makedirs(f"{d}/emptydir")
    os.makedirs(f"{d}/hfdir")
    with open(f"{d}/garbage.model", "wb") as f:
        f.write(b"this is not a sentencepiece model\n" * 10)
    with open(f"{d}/afile", "w") as f:
        f.write("x")
    with open(f"{d}/bad.jsonl", "w") as f:
        f.write('{"text": "1 2 3"}\n{not json\n')
    with open(f"{d}/blank.jsonl", "w") as f:
        f.write("\n")
    with open(f"{d}/words.txt", "w") as f:
        f.write("one two three\n")
    _config_files(d)
    _checkpoint_fixtures(d)


def _config_files(d: str) -> None:
    """``--config`` files: run.yaml holds $TINY; the others one mistake each."""
    lines, i = [], 0
    while i < len(TINY):
        key = TINY[i][2:]
        if i + 1 < len(TINY) and not TINY[i + 1].startswith("--"):
            lines.append(f"{key}: '{TINY[i + 1]}'")
            i += 2
        else:
            lines.append(f"{key}: true")
            i += 1
    files = {
        "run": "\n".join(lines),
        "badkey": "num_layerz: 2",
        "badval": "num-layers: two",
        "notyaml": "a: [",
        "range": "num-layers: 0",
        "evalzero": "eval-interval: 5\neval-iters: 0",
    }
    for name, text in files.items():
        with open(f"{d}/{name}.yaml", "w") as f:
            f.write(text + "\n")


def snapshot(root: str) -> dict:
    """Every file under ``root`` (but the lock) and its hash."""
    import hashlib

    out = {}
    for where, _, names in os.walk(root):
        for n in names:
            if not n.startswith(".lock"):
                with open(os.path.join(where, n), "rb") as f:
                    out[os.path.relpath(os.path.join(where, n), root)] = hashlib.sha256(
                        f.read()
                    ).hexdigest()
    return out


def _checkpoint_fixtures(d: str) -> None:
    """$D/ck-base: iterations 2 and 4 of $TINY (its hashes kept to show it untouched), and
    copies: one to overwrite, one with an edited manifest, one with a truncated file, one
    holding the lock of a job that is gone."""
    base = f"{d}/ck-base"
    subprocess.run(
        pretrain(*TINY, "--train-iters", "4", "--save-interval", "2", "--save", base),
        env=environment({}),
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=600,
    )
    os.makedirs(f"{d}/ck-locked")
    with open(f"{base}.json", "w") as f:
        json.dump(snapshot(base), f)
    for name in ("ck-over", "ck-edit", "ck-trunc", "ck-stale"):
        shutil.copytree(base, f"{d}/{name}")
    manifest = f"{d}/ck-edit/iter_0000004/manifest.json"
    with open(manifest) as f:
        text = f.read()
    edited = text.replace('"tensor_model_parallel_size": 1', '"tensor_model_parallel_size": 2')
    assert edited != text, "the manifest names no TP size"
    with open(manifest, "w") as f:
        f.write(edited)
    victim = f"{d}/ck-trunc/iter_0000004/mp_rank_00/optim_dp000.pt"
    os.truncate(victim, os.path.getsize(victim) // 2)
    gone = subprocess.Popen(["true"])
    gone.wait()
    with open(f"{d}/ck-stale/.lock", "w") as f:
        json.dump({"host": socket.gethostname(), "pid": gone.pid, "started": None}, f)


def _damaged_copies(d: str, small: str) -> None:
    with open(f"{small}.bin", "rb") as f:
        data = f.read()
    with open(f"{small}.idx", "rb") as f:
        index = f.read()
    for name, b, i in (
        ("truncbin", data[: len(data) // 2], index),
        ("badmagic", data, b"XXXXXXXXX" + index[9:]),
        ("truncidx", data, index[: len(index) - 16]),
    ):
        with open(f"{d}/{name}.bin", "wb") as f:
            f.write(b)
        with open(f"{d}/{name}.idx", "wb") as f:
            f.write(i)


# ------------------------------------------------------------------ special runners
def no_checkpoint(d, rc, out, err):
    if os.path.exists(f"{d}/ck-fp16/latest_checkpointed_iteration.txt"):
        return "silent: saved a checkpoint of the diverged run"
    return None


def base_untouched(d, rc, out, err):
    with open(f"{d}/ck-base.json") as f:
        if snapshot(f"{d}/ck-base") != json.load(f):
            return "data lost: a checkpoint in $D/ck-base changed"
    return None


def save_survived_kill(d, rc, out, err):
    from mp_offload.checkpoint import read_latest

    latest = read_latest(f"{d}/ck-killed")
    return None if latest == 2 else f"data lost: the latest checkpoint is {latest}, not 2"


def locked_save(case, d):
    """The case while another process holds the lock of its --save directory."""
    hold = (
        "import sys, time\nfrom mp_offload.checkpoint import SaveLock\n"
        "SaveLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\ntime.sleep(600)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, f"{d}/ck-locked"],
        env=environment({}),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if holder.stdout.readline().strip() != "locked":
            return None, "", "", "other: the lock holder did not start"
        return run_command(case.cmd, d, case.env, case.timeout)
    finally:
        holder.kill()
        holder.wait()


def port_in_use(case, d):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        env = dict(
            WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1])
        )
        return run_command(case.cmd, d, env, case.timeout)


def _start_training(case, d, name):
    """torchrun 2 training 'forever' with --save; returns (process, log, checkpoint dir)."""
    log, ck = f"{d}/{name}.jsonl", f"{d}/ck-{name}"
    cmd = expand(case.cmd, d) + ["--train-iters", "100000", "--save", ck, "--log-json", log]
    proc = subprocess.Popen(
        cmd,
        env=environment({}),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + case.timeout
    while time.time() < deadline and (not os.path.exists(log) or sum(1 for _ in open(log)) < 3):
        time.sleep(0.5)
    return proc, log, ck


def _saved_last(log, ck):
    from mp_offload.checkpoint import read_latest

    last = [json.loads(ln)["iteration"] for ln in open(log) if '"loss"' in ln][-1]
    saved = read_latest(ck)
    return None if saved == last else f"data lost: trained to {last}, saved {saved}"


def sigterm_torchrun(case, d):
    proc, log, ck = _start_training(case, d, "sigterm")
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return None, "", "", "hang"
    # torchrun itself exits non-zero on a signal; what counts is the workers' stop and save
    return 0, out, err, _saved_last(log, ck)


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def kill9_torchrun(case, d):
    proc, log, ck = _start_training(case, d, "kill9")
    workers = _children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    deadline = time.time() + 90
    while time.time() < deadline and not all(_gone(w) for w in workers):
        time.sleep(0.2)
    orphans = [w for w in workers if not _gone(w)]
    for w in orphans:
        os.kill(w, signal.SIGKILL)
    out, err = proc.communicate()
    if not workers:
        return 0, out, err, "other: no workers found"
    if orphans:
        return 0, out, err, "hang"
    return 0, out, err, _saved_last(log, ck)


def preprocess_keeps_old(case, d):
    old = f"{d}/keep"
    run_command(
        tool(
            "preprocess_data",
            "--input",
            "$D/small.jsonl",
            "--output-prefix",
            old,
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "100",
        ),
        d,
        {},
        case.timeout,
    )
    before = {s: open(f"{old}_text_document{s}", "rb").read() for s in (".bin", ".idx")}
    cmd = [a if a != "$D/out" else old for a in case.cmd]
    rc, out, err, _ = run_command(cmd, d, {}, case.timeout)
    after = {
        s: open(f"{old}_text_document{s}", "rb").read()
        for s in (".bin", ".idx")
        if os.path.exists(f"{old}_text_document{s}")
    }
    return rc, out, err, None if after == before else "data lost: the old dataset changed"


# ----------------------------------------------------------------------- judging
def run_command(cmd, d, env, timeout):
    try:
        res = subprocess.run(
            expand(cmd, d),
            env=environment({k: v.replace("$D", d) for k, v in env.items()}),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        return None, _text(e.stdout), _text(e.stderr), "hang"
    return res.returncode, res.stdout, res.stderr, None


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
