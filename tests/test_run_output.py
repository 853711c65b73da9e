"""What a user sees of a run: progress with ETA, greedy samples, the closing summary, and
the README's main job (scripts/pretrain_gpt_tiny_cpu.sh) leaving something to use."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
from dist_helpers import free_port, run_distributed
from helpers import ROOT, tiny_model_flags

from mp_offload.training import pretrain

RUN = [
    *tiny_model_flags(vocab_size=100),
    "--mock-data",
    "--micro-batch-size",
    "2",
    "--lr",
    "1e-2",
    "--train-iters",
    "6",
    "--eval-interval",
    "3",
    "--eval-iters",
    "1",
    "--log-interval",
    "2",
    "--cpu-offload",
    "--sample-prompt",
    "3 5 7",
    "--sample-tokens",
    "5",
]


def pretrain_here(argv):
    """pretrain() in this process (world 1, a free port), leaving pytest's signal handlers
    as they were."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    port = os.environ.get("MASTER_PORT")
    os.environ["MASTER_PORT"] = str(free_port())
    try:
        return pretrain(argv)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        if port is None:
            del os.environ["MASTER_PORT"]
        else:
            os.environ["MASTER_PORT"] = port


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_progress_samples_and_summary(tmp_path, capsys):
    log = tmp_path / "new" / "dir" / "log.jsonl"  # --log-json creates its directories
    pretrain_here([*RUN, "--log-json", str(log), "--save", str(tmp_path / "ck")])
    out = capsys.readouterr().out
    assert re.search(r" iteration 2/6 \| elapsed \d+:\d\d \| ETA \d+:\d\d \|", out), out
    assert " iteration 6/6 | elapsed" in out
    for it in (0, 3, 6):  # the baseline evaluation, the one at 3, the end
        assert f" sample at iteration {it} (greedy):\n    | 3 5 7" in out
    recs = records(log)
    samples = {r["iteration"]: r["sample"] for r in recs if "sample" in r}
    assert sorted(samples) == [0, 3, 6]
    assert all(s.startswith("3 5 7") and len(s.split()) <= 8 for s in samples.values())
    assert len([r for r in recs if "loss" in r]) == 6
    summary = out[out.index(" run summary:") :]
    assert " iterations  6/6 in " in summary
    assert " tokens      192 trained on in all; this session 192 " in summary  # 6 x 2 x 16
    assert re.search(
        r"final loss  at iteration 6: train \d\.\d{4} \| valid \d\.\d{4} \(ppl [\d.]+\) \| "
        r"test \d\.\d{4}",
        summary,
    ), summary
    assert f"checkpoint  {tmp_path / 'ck'} (iteration 6)" in summary
    # The resolved configuration next to the checkpoints, readable by --config.
    from mp_offload.config import parse_args

    again = parse_args(["--config", str(tmp_path / "ck" / "config.yaml")])
    assert again.log.sample_prompt == "3 5 7" and again.model.hidden_size == 32
    assert again.train.train_iters == 6 and again.ckpt.save == str(tmp_path / "ck")


def test_bad_sample_prompt_stops_before_training(capfd):
    with pytest.raises(SystemExit):  # a mock-data run's tokenizer reads ids
        pretrain_here([*RUN, "--sample-prompt", "not ids"])
    assert "--sample-prompt 'not ids'" in capfd.readouterr().err


def _losses(path):
    return [r["loss"] for r in records(path) if "loss" in r]


def _reruns_from_its_config_yaml(tmp_path, flags, monkeypatch):
    """A short run with --save, then ``--config <save>/config.yaml`` and no other flag
    (its checkpoints removed, so the same --save takes it): the same losses, bitwise.
    The first run's flags stay as ``resolve`` made them (``Args`` are final)."""
    import copy
    import shutil

    from mp_offload import training

    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    seen, real_run = [], training._run

    def checked_run(flags, *rest):
        before = copy.deepcopy(flags)
        out = real_run(flags, *rest)
        seen.append(flags == before)
        return out

    monkeypatch.setattr(training, "_run", checked_run)
    pretrain_here([*flags, "--save", str(ck), "--log-json", str(log)])
    first = _losses(log)
    for entry in os.listdir(ck):
        if entry != "config.yaml":
            path = ck / entry
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    log.unlink()
    pretrain_here(["--config", str(ck / "config.yaml")])
    assert len(first) == 6 and _losses(log) == first
    assert seen == [True, True]


def test_a_run_reruns_bitwise_from_its_config_yaml(tmp_path, monkeypatch):
    _reruns_from_its_config_yaml(tmp_path, RUN, monkeypatch)


def test_a_default_corpus_run_reruns_bitwise_from_its_config_yaml(tmp_path, monkeypatch):
    """The default corpus (a small one, in a cache of its own): its tokenizer model is
    found by the data layer, not a flag, and config.yaml must not name it."""
    import functools

    from mp_offload.data import default_corpus

    small = functools.partial(
        default_corpus.prepare_default_corpus, vocab_size=512, max_bytes=150_000
    )
    monkeypatch.setattr(default_corpus, "prepare_default_corpus", small)
    flags = [f for f in RUN if f not in ("--mock-data",)]
    flags = flags[: flags.index("--sample-prompt")] + ["--data-cache-dir", str(tmp_path / "c")]
    _reruns_from_its_config_yaml(tmp_path, flags, monkeypatch)


def test_a_refused_resume_leaves_config_yaml_alone(tmp_path, capfd):
    """A resume the checkpoint refuses (another --hidden-size) must not rewrite the
    configuration recorded beside the checkpoints."""
    ck = str(tmp_path / "ck")
    pretrain_here([*RUN, "--save", ck, "--train-iters", "2"])
    with open(os.path.join(ck, "config.yaml")) as f:
        recorded = f.read()
    with pytest.raises(SystemExit):
        pretrain_here([*RUN, "--save", ck, "--load", ck, "--hidden-size", "64"])
    assert "--hidden-size is 64 here but 32 in the checkpoint" in capfd.readouterr().err
    with open(os.path.join(ck, "config.yaml")) as f:
        assert f.read() == recorded


def test_mock_data_of_a_one_id_vocabulary_still_trains():
    """The run's tokenizer for mock data reads ids; one id has none to read, and the run
    needs none (only --sample-prompt would)."""
    flags = RUN[: RUN.index("--sample-prompt")]
    flags[flags.index("--vocab-size") + 1] = "1"
    assert pretrain_here([*flags, "--train-iters", "1"])["iteration"] == 1


def test_a_run_puts_back_the_signal_handlers_it_replaced(tmp_path):
    def mine(signum, frame):
        pass

    saved = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}
    port = os.environ.get("MASTER_PORT")
    os.environ["MASTER_PORT"] = str(free_port())
    try:
        pretrain([*RUN, "--train-iters", "1"])
        assert [signal.getsignal(s) for s in saved] == [mine, mine]
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        os.environ.pop("MASTER_PORT") if port is None else os.environ.update(MASTER_PORT=port)


def _tp2_worker(rank, world, argv):
    pretrain(argv)


@pytest.mark.slow
def test_sampling_at_tp2_dp2_matches_generation_from_the_checkpoint(tmp_path):
    """Every rank takes part in sampling (TP=2 x DP=2, nothing hangs); the last sample is
    what tools/generate.py --greedy gives from the saved checkpoint (fp32)."""
    from mp_offload.generation import main as generate_main

    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    run_distributed(
        _tp2_worker,
        4,
        [*RUN, "--tensor-model-parallel-size", "2", "--log-json", str(log), "--save", str(ck)],
    )
    samples = {r["iteration"]: r["sample"] for r in records(log) if "sample" in r}
    assert sorted(samples) == [0, 3, 6]
    got = generate_main(
        ["--load", str(ck), "--prompt", "3 5 7", "--max-new-tokens", "5", "--greedy"]
    )
    assert samples[6] == "3 5 7" + (" " + got["text"] if got["text"] else "")


@pytest.mark.slow
@pytest.mark.parametrize("model,arch", [("gpt", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM")])
def test_main_job_leaves_a_checkpoint_samples_a_plot_and_next_commands(tmp_path, model, arch):
    """scripts/pretrain_gpt_tiny_cpu.sh from scratch (a few iterations of a smaller model
    through extra flags), then the commands it prints: generate and the HF export."""
    run = tmp_path / "run"
    env = dict(
        os.environ,
        SKIP_SETUP="1",
        RUN_DIR=str(run),
        TRAIN_ITERS="4",
        MODEL=model,
        PYTHONPATH=ROOT,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    res = subprocess.run(
        [
            "bash",
            "scripts/pretrain_gpt_tiny_cpu.sh",
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--eval-iters",
            "2",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert " iteration 4/4 | elapsed" not in out  # logs every 10 iterations
    assert " sample at iteration 0 (greedy):\n    | def parse(" in out
    assert " sample at iteration 4 (greedy):\n    | def parse(" in out
    assert " run summary:" in out and "iterations  4/4" in out
    with open(run / "ckpt" / "latest_checkpointed_iteration.txt") as f:
        assert f.read().strip() == "4"
    with open(run / "loss.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert f"loss curve: {run}/loss.png" in out
    nxt = out[out.index("Next:") :].splitlines()
    resume = next(ln.strip() for ln in nxt if "pretrain_gpt_tiny_cpu.sh" in ln)
    assert resume.startswith("TRAIN_ITERS=8 ") and resume.endswith(
        "bash scripts/pretrain_gpt_tiny_cpu.sh --num-layers 2 --hidden-size 64 --eval-iters 2"
    )
    assert f"RUN_DIR={run}" in resume and "SKIP_SETUP=1" in resume
    assert f"MODEL={model}" in resume
    for tool, check in (("tools/generate.py", "def parse("), ("tools/convert_checkpoint.py", arch)):
        line = next(ln.strip() for ln in nxt if tool in ln)
        argv = shlex.split(line)
        assert argv[0] == "python3" and argv[1] == tool
        if tool == "tools/generate.py":
            assert argv[argv.index("--prompt") + 1] == "def parse("
            argv[argv.index("--max-new-tokens") + 1] = "4"  # the same command, shorter
        res = subprocess.run(
            [sys.executable, *argv[1:]],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0 and check in res.stdout, res.stderr[-3000:]
    assert os.path.exists(run / "hf" / "model.safetensors")
    _export_loads_in_transformers(str(run / "hf"), str(run / "ckpt"))


def _export_loads_in_transformers(hf_dir, ckpt):
    """The exported directory: transformers' Auto classes load it with every weight
    in place, and the model's logits are ours."""
    import torch
    import transformers

    from mp_offload.checkpoint import resolve_checkpoint
    from mp_offload.generation import load_model

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    ours = load_model(resolve_checkpoint(ckpt))
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ids = torch.tensor([tok("def parse(self, text):\n    return")["input_ids"]])
    with torch.no_grad():
        want = ours(ids)[..., : ours.cfg.vocab_size]
        torch.testing.assert_close(model(ids).logits, want, atol=1e-4, rtol=0)


class _FakeWandb:
    """Stands in for the wandb package: records init/log/finish."""

    def __init__(self):
        self.calls = []

    def init(self, **kw):
        self.calls.append(("init", kw))
        return self

    def log(self, data, step):
        self.calls.append(("log", step, data))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_project_logs_when_installed_and_warns_once_when_not(monkeypatch, capsys):
    from mp_offload.config import LoggingConfig
    from mp_offload.runtime.logger import Logger

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = Logger(LoggingConfig(wandb_project="p"), is_main=True, run_config={"lr": 0.1})
    logger.evaluation(3, "valid", 2.0)
    logger.close()
    assert fake.calls[0] == ("init", {"project": "p", "config": {"lr": 0.1}})
    assert fake.calls[1][:2] == ("log", 3) and fake.calls[1][2]["valid_loss"] == 2.0
    assert fake.calls[-1] == ("finish",)
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: import fails
    Logger(LoggingConfig(wandb_project="p"), is_main=True).close()
    warned = [ln for ln in capsys.readouterr().out.splitlines() if "wandb" in ln]
    assert len(warned) == 1 and "--wandb-project p: wandb is not installed" in warned[0]


def test_a_sample_of_blank_lines_prints_as_one_line():
    """An early model's sample is often newlines and indentation: not 24 empty lines."""
    from mp_offload.runtime.logger import sample_block

    assert sample_block("def parse(" + "\n        " * 12) == (
        "    | def parse(\n    | (12 blank lines)"
    )
    two = "a\n\n\nb"  # two blank lines between definitions stay as they are
    assert sample_block(two) == "    | a\n    | \n    | \n    | b"
    assert sample_block("x\n \n\n  \n\ny") == "    | x\n    | (4 blank lines)\n    | y"
    assert sample_block("") == "    | "


def test_the_summarys_losses_name_their_iterations():
    """A stopped run's last evaluation (here the iteration-0 baseline) is not passed off
    as the final one."""
    from mp_offload.runtime.logger import final_losses

    evals = {"valid": (0, 8.3465)}
    assert final_losses({"iteration": 30, "loss": 6.5}, evals) == (
        "train 6.5000 at iteration 30 | valid 8.3465 (ppl 4215.4) at iteration 0"
    )
    evals = {"valid": (30, 6.0), "test": (30, 6.25)}
    assert final_losses({"iteration": 30, "loss": 6.5}, evals) == (
        "at iteration 30: train 6.5000 | valid 6.0000 (ppl 403.4) | test 6.2500 (ppl 518.0)"
    )
    assert final_losses({"iteration": 0}, {}) == "-"
