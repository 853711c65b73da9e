"""The cases the reliability probe found unclear or silent: each one
ends with a line naming the flag, the file or the number."""

import os
import shutil
import subprocess
import sys

import pytest
from pretrain_runs import TINY, assert_one_line, pretrain_env, run_pretrain

from mp_offload.data.preprocess import PreprocessError, preprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOCK = [*TINY, "--mock-data"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A mock-data run saved at iterations 2 and 4."""
    d = str(tmp_path_factory.mktemp("ck") / "ck")
    res = run_pretrain(*MOCK, "--train-iters", "4", "--save-interval", "2", "--save", d)
    assert res.returncode == 0, res.stderr[-2000:]
    return d


def _generate(*argv, **kwargs):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "generate.py"), *argv],
        capture_output=True, text=True, timeout=120, env=pretrain_env(), cwd=ROOT, **kwargs,
    )  # fmt: skip


@pytest.mark.slow
def test_a_latest_pointer_to_a_missing_iteration_names_the_manifest(ckpt, tmp_path):
    d = str(tmp_path / "ck")
    os.system(f"cp -r {ckpt} {d}")
    with open(os.path.join(d, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("12")
    res = run_pretrain(*MOCK, "--train-iters", "6", "--save", d, "--load", d)
    assert_one_line(
        res, f"--load {d}: {d}/iter_0000012/manifest.json is missing (the latest pointer", 2
    )


@pytest.mark.slow
def test_resuming_past_the_new_train_iters_names_the_flag(ckpt, tmp_path):
    res = run_pretrain(
        *MOCK, "--train-iters", "2", "--load", f"{ckpt}/iter_0000004", "--save", str(tmp_path)
    )
    assert_one_line(res, "--train-iters 2 is below iteration 4 of the checkpoint loaded", 2)


@pytest.mark.slow
def test_train_iters_0_names_no_checkpoint_it_did_not_write(tmp_path):
    res = run_pretrain(*MOCK, "--train-iters", "0", "--save", str(tmp_path / "ck"))
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout + res.stderr
    assert "checkpoint  none written to" in out and "(iteration 0)" not in out, out[-1000:]


def test_preprocess_output_prefix_under_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    (tmp_path / "in.jsonl").write_text('{"text": "1 2 3"}\n')
    with pytest.raises(PreprocessError, match=r"^--output-prefix .*/afile/sub/x: cannot make"):
        preprocess(
            [str(tmp_path / "in.jsonl")],
            str(tmp_path / "afile" / "sub" / "x"),
            "NullTokenizer",
            vocab_size=10,
        )


@pytest.mark.slow
def test_generate_prompt_and_output_json_are_named(ckpt, tmp_path):
    res = _generate("--load", ckpt, "--prompt", "1 abc")
    assert res.returncode != 0 and res.stderr.strip() == (
        "generate: --prompt '1 abc': 'abc' is not a token id: the NullTokenizer reads "
        "whitespace-separated ids 0..94"
    ), res.stderr
    res = _generate("--load", ckpt, "--output-json", str(tmp_path / "no" / "x.json"))
    assert (
        res.stderr.strip()
        == f"generate: --output-json {tmp_path}/no/x.json: no directory {tmp_path}/no"
    )


def test_generate_refuses_a_tokenizer_smaller_than_the_model(ckpt, monkeypatch):
    from mp_offload import generation
    from mp_offload.data.tokenizer import NullTokenizer

    monkeypatch.setattr(generation, "tokenizer_for", lambda *a, **k: (NullTokenizer(10), False))
    with pytest.raises(SystemExit, match="the tokenizer has 11 ids, the model 96: not the"):
        generation.main(["--load", ckpt, "--max-new-tokens", "2"])


@pytest.mark.slow
def test_generate_bad_tp_under_torchrun_is_one_line(ckpt):
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [os.path.join(ROOT, "tools", "generate.py"), "--load", ckpt]
        + ["--tensor-model-parallel-size", "3"],
        capture_output=True, text=True, timeout=120, env=pretrain_env(), cwd=ROOT,
    )  # fmt: skip
    assert res.returncode != 0
    assert "generate: --tensor-model-parallel-size 3 does not divide the world size 2" in res.stderr
    assert (
        'Traceback (most recent call last):\n  File "/'
        not in res.stderr.split("torch.distributed.elastic")[0]
    )


# ------------------------------------------------------------------ smaller (item 11)
def test_abbreviated_flags_are_errors_with_did_you_mean():
    from mp_offload.config import ConfigError, parse_args

    with pytest.raises(
        ConfigError, match="unrecognized argument --num-layer: did you mean --num-layers"
    ):
        parse_args(["--num-layer", "2", "--mock-data"])


def test_generate_unknown_flag_says_did_you_mean(ckpt):
    from mp_offload import generation

    with pytest.raises(
        SystemExit,
        match="^generate: unrecognized argument --max-new-token: did you mean --max-new-tokens",
    ):
        generation.main(["--load", ckpt, "--max-new-token", "2"])


def test_the_progress_line_on_the_cpu_has_no_device_fields():
    from mp_offload.runtime.logger import _device_fields

    rec = dict(loss_scale=1.0, skipped_iterations=0, tokens_per_sec=10.0, tflops_per_device=0.001)
    rec.update(peak_device_gb=0.0, peak_host_gb=0.3, host_device_bytes_per_param=4.0)
    assert _device_fields(rec) == " | tokens/s 10 | TFLOPS/dev 0.001 | peak host mem GB 0.30"
    fp16 = _device_fields(dict(rec, loss_scale=65536.0))
    assert fp16.startswith(" | loss scale 65536 | skipped 0 | tokens/s"), fp16


@pytest.mark.slow
def test_a_llama_run_is_not_called_gpt():
    llama = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope"]
    res = run_pretrain(*MOCK, *llama, "--train-iters", "1")
    assert res.returncode == 0 and "Llama: 0.04M parameters" in res.stdout + res.stderr, res.stderr[
        -2000:
    ]


# --------------------------------------------------------- conversions keep the tokenizer
def test_save_merged_and_hf_import_carry_the_tokenizer(tmp_path):
    import torch
    from helpers import tiny_gpt_config

    from mp_offload.checkpoint import FullTensors, merge_checkpoint
    from mp_offload.checkpoint.hf_common import import_args
    from mp_offload.checkpoint.offline import write_checkpoint
    from mp_offload.checkpoint.on_disk import tokenizer_args
    from mp_offload.model.gpt import GPTConfig

    model_file = tmp_path / "tok.model"
    model_file.write_bytes(b"a SentencePiece model")
    data = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": str(model_file)}
    cfg = GPTConfig(**tiny_gpt_config())
    src = write_checkpoint(
        str(tmp_path / "src"), 4, 32, cfg, 2, lambda name, key, shape, dim: torch.zeros(shape),
        args={"data": data},
    )  # fmt: skip
    merged = merge_checkpoint(src, str(tmp_path / "merged"))
    model_file.unlink()  # the run's file is gone: the merged copy must stand alone
    shutil.rmtree(tmp_path / "src")
    found = tokenizer_args(merged, FullTensors(merged).common())["tokenizer_model"]
    assert found.startswith(merged) and open(found, "rb").read() == b"a SentencePiece model"
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    assert import_args(cfg, str(tmp_path / "hf"))["data"] == {
        "tokenizer_type": "HuggingFaceTokenizer",
        "tokenizer_model": str(tmp_path / "hf"),
    }


def test_generate_on_a_misspelt_directory_names_the_closest_one(tmp_path, monkeypatch):
    from mp_offload.generation import main

    (tmp_path / "runs" / "tiny_cpu" / "ckpt").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["--load", "runs/tiny_cpu/ckp"])
    assert str(e.value) == (
        "generate: --load runs/tiny_cpu/ckp: no such directory; did you mean runs/tiny_cpu/ckpt?"
    )
    with pytest.raises(SystemExit) as e:
        main(["--load", "elsewhere/x"])
    assert str(e.value) == "generate: --load elsewhere/x: no such directory"


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags,line",
    [
        (["--top-p", "0"], "generate: --top-p must be > 0 and <= 1, got 0"),
        (["--max-new-token", "2"], "did you mean --max-new-tokens?"),
        ([], "no such directory"),
    ],
)
def test_a_generate_error_under_torchrun_is_printed_once(tmp_path, flags, line):
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [os.path.join(ROOT, "tools", "generate.py"), "--load", str(tmp_path / "nockpt")]
        + flags,
        capture_output=True, text=True, timeout=300, env=pretrain_env(), cwd=ROOT,
    )  # fmt: skip
    assert res.returncode != 0
    ours = [x for x in res.stderr.splitlines() if x.startswith("generate: ")]
    assert len(ours) == 1 and line in ours[0], res.stderr[-3000:]
