"""User tools: TP merge, Hugging Face GPT-2 export/import, generation at any TP, loss plots."""

import json
import os

import pytest
import torch
from dist_helpers import pretrain_worker, run_distributed
from helpers import load_tool, tiny_model_flags

from mp_offload.checkpoint import (
    ConversionError,
    FullTensors,
    import_hf,
    read_latest,
    resolve_checkpoint,
)
from mp_offload.checkpoint.hf_gpt2 import check_gpt2_compatible
from mp_offload.checkpoint.safetensors_io import SafeTensorsFile, write_safetensors
from mp_offload.data.loader import MockGPTDataset
from mp_offload.generation import load_model, sample_token
from mp_offload.generation import main as generate_main

VOCAB, SEQ = 100, 16
BASE = tiny_model_flags(seq_length=SEQ, vocab_size=VOCAB) + [
    "--mock-data",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-2",
    "--lr-warmup-iters",
    "2",
    "--train-iters",
    "8",
    "--eval-interval",
    "3",
    "--eval-iters",
    "1",
    "--log-interval",
    "100",
    "--cpu-offload",
    "--reduce-bucket-size",
    "3000",
]


def train(world, tp, *extra):
    run_distributed(
        pretrain_worker, world, BASE + ["--tensor-model-parallel-size", str(tp), *extra]
    )


def losses(path):
    with open(path) as f:
        return {r["iteration"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """8 iterations at TP=2 (DP=1), checkpoints at 4 and 8."""
    d = tmp_path_factory.mktemp("trained")
    train(
        2, 2, "--save", str(d / "ckpt"), "--save-interval", "4", "--log-json", str(d / "log.jsonl")
    )
    assert read_latest(str(d / "ckpt")) == 8
    return d


def _logits_tp1(ckpt, tokens):
    with torch.no_grad():
        return load_model(resolve_checkpoint(ckpt))(tokens)[..., :VOCAB]


# ------------------------------------------------------------------------ merge
@pytest.mark.slow
def test_merged_tp1_checkpoint_continues_like_tp2(trained, tmp_path):
    merged = str(tmp_path / "merged")
    assert (
        load_tool("convert_checkpoint").main(
            ["--load", str(trained / "ckpt"), "--iteration", "4", "--save-merged", merged]
        )
        == 0
    )
    manifest = FullTensors(resolve_checkpoint(merged)).manifest
    assert (manifest["tensor_model_parallel_size"], manifest["data_parallel_size"]) == (1, 1)
    assert manifest["iteration"] == 4
    want = losses(trained / "log.jsonl")
    # TP=1 DP=1: the saved layout is this run's (exact resume); TP=2: the resharding loader.
    for world, tp in ((1, 1), (2, 2)):
        log = str(tmp_path / f"tp{tp}.jsonl")
        train(world, tp, "--load", merged, "--log-json", log)
        got = losses(log)
        assert sorted(got) == [5, 6, 7, 8]
        for it in got:  # fp32: only the reduction order differs from the TP=2 original
            assert abs(got[it] - want[it]) <= 1e-5 * want[it], (tp, it, got[it], want[it])


# ------------------------------------------------------------------ HF GPT-2
@pytest.mark.slow
def test_hf_export_gives_the_same_logits_in_transformers(trained, tmp_path):
    import transformers

    hf = str(tmp_path / "hf")
    assert (
        load_tool("convert_checkpoint").main(["--load", str(trained / "ckpt"), "--hf-out", hf]) == 0
    )
    with open(os.path.join(hf, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["vocab_size"] == VOCAB and cfg["architectures"] == ["GPT2LMHeadModel"]
    model = transformers.GPT2LMHeadModel.from_pretrained(hf, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(tokens).logits
    ours = _logits_tp1(str(trained / "ckpt"), tokens)
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_hf_import_export_round_trip_and_finetune(trained, tmp_path):
    tool = load_tool("convert_checkpoint")
    hf1, hf2, imported = (str(tmp_path / n) for n in ("hf1", "hf2", "imported"))
    assert tool.main(["--load", str(trained / "ckpt"), "--hf-out", hf1]) == 0
    assert (
        tool.main(
            [
                "--hf-in",
                hf1,
                "--save",
                imported,
                "--tensor-model-parallel-size",
                "2",
                "--make-vocab-size-divisible-by",
                "8",
            ]
        )
        == 0
    )
    assert tool.main(["--load", imported, "--hf-out", hf2]) == 0
    a = SafeTensorsFile(os.path.join(hf1, "model.safetensors"))
    b = SafeTensorsFile(os.path.join(hf2, "model.safetensors"))
    assert a.names == b.names and len(a.names) == 4 + 12 * 2
    for n in a.names:
        assert torch.equal(a.get(n), b.get(n)), n
    configs = []
    for d in (hf1, hf2):
        with open(os.path.join(d, "config.json")) as f:
            configs.append(json.load(f))
    assert configs[0] == configs[1]
    # pretrain_gpt.py --finetune starts from it: its first loss is the imported model's
    # loss on the first global batch (samples 0..7 of the mock stream, seed 1234).
    log = str(tmp_path / "ft.jsonl")
    train(2, 2, "--load", imported, "--finetune", "--train-iters", "1", "--log-json", log)
    ds = MockGPTDataset(8, SEQ, VOCAB, 1234)
    batch = torch.stack([torch.from_numpy(ds[i]["text"]) for i in range(8)])
    with torch.no_grad():
        want = load_model(resolve_checkpoint(imported))(batch[:, :-1], batch[:, 1:]).mean()
    assert abs(losses(log)[1] - want.item()) <= 1e-5 * want.item()


def test_import_a_transformers_gpt2(tmp_path):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=12, n_embd=24, n_layer=2, n_head=4
    )  # n_inner None: 4h
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # HF zeroes biases and sets LayerNorms to 1: make every tensor count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(tmp_path / "hf"))
    ckpt = import_hf(str(tmp_path / "hf"), str(tmp_path / "ck"), 1, make_vocab_size_divisible_by=16)
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(tokens).logits
        ours = load_model(ckpt)(tokens)
    assert ours.shape[-1] == 64  # padded; the padding never reaches a prediction
    torch.testing.assert_close(theirs, ours[..., :50], atol=2e-5, rtol=1e-5)


def test_export_refuses_what_gpt2_cannot_express():
    from mp_offload.checkpoint.hf_gpt2 import gpt2_name_map

    names = list(gpt2_name_map(2))
    cfg = {"num_layers": 2, "hidden_size": 32, "vocab_size": 100}
    check_gpt2_compatible(cfg, names)
    with pytest.raises(ConversionError, match="--swiglu"):
        check_gpt2_compatible(dict(cfg, swiglu=True), names)
    with pytest.raises(ConversionError, match="output_layer.weight"):
        check_gpt2_compatible(cfg, names + ["output_layer.weight"])


@pytest.mark.parametrize("writer_package", [False, True])
def test_safetensors_files_read_back(tmp_path, writer_package):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "d": torch.randn(1, 1),
    }
    path = str(tmp_path / "x.safetensors")
    write_safetensors(
        path,
        [(n, list(t.shape), t.dtype) for n, t in tensors.items()],
        tensors.__getitem__,
        metadata={"format": "pt"},
        use_package=writer_package,
    )
    for pkg in (False, True):  # our reader and the safetensors package (a test extra)
        f = SafeTensorsFile(path, use_package=pkg)
        assert sorted(f.names) == sorted(tensors)
        for n, t in tensors.items():
            assert torch.equal(f.get(n), t), (pkg, n)


# ------------------------------------------------------------------- generation
def _generate_worker(rank, world, argv):
    generate_main(argv)


@pytest.mark.slow
def test_generate_greedy_tp2_equals_tp1(trained, tmp_path):
    # 8 prompt + 20 new tokens > 16 positions: the context is truncated on the left.
    argv = [
        "--load",
        str(trained / "ckpt"),
        "--prompt",
        "3 5 7 9 11 13 15 17",
        "--max-new-tokens",
        "20",
        "--greedy",
    ]
    run_distributed(
        _generate_worker,
        2,
        argv + ["--tensor-model-parallel-size", "2", "--output-json", str(tmp_path / "tp2.json")],
    )
    tp1 = generate_main(argv + ["--output-json", str(tmp_path / "tp1.json")])
    with open(tmp_path / "tp2.json") as f:
        tp2 = json.load(f)
    assert tp1["prompt_ids"] == [3, 5, 7, 9, 11, 13, 15, 17]
    assert len(tp1["generated_ids"]) == 20  # mock data has no end-of-document to stop at
    assert tp2["generated_ids"] == tp1["generated_ids"]
    assert all(0 <= t < VOCAB for t in tp1["generated_ids"])
    sampled = [
        generate_main(argv[:-1] + ["--top-k", "5", "--temperature", "0.8", "--seed", "3"])[
            "generated_ids"
        ]
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]  # seeded


def test_sampling_never_picks_padded_vocabulary():
    logits = torch.randn(128)
    logits[100:] = 50.0  # the padding would win every draw if it were not masked
    gen = torch.Generator().manual_seed(0)
    assert sample_token(logits, 100, greedy=True) == int(torch.argmax(logits[:100]))
    for kw in ({}, {"top_k": 3}, {"top_p": 0.5}, {"temperature": 5.0}):
        assert all(sample_token(logits, 100, generator=gen, **kw) < 100 for _ in range(200))
    best = int(torch.argmax(logits[:100]))
    assert sample_token(logits, 100, top_k=1, generator=gen) == best
    assert sample_token(logits, 100, top_p=1e-6, generator=gen) == best


# ------------------------------------------------------------------------ plots
@pytest.mark.slow
def test_plot_loss_writes_a_png(trained, tmp_path):
    out = str(tmp_path / "loss.png")
    assert (
        load_tool("plot_loss").main(["--log-json", str(trained / "log.jsonl"), "--out", out]) == 0
    )
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    train_, valid = load_tool("plot_loss").read_log(str(trained / "log.jsonl"))
    assert sorted(train_) == list(range(1, 9)) and 0 in valid
