"""Hugging Face Llama import/export against transformers' own LlamaForCausalLM.

Every model here is a random LlamaForCausalLM made in the test (nothing downloaded),
with its norms and biases perturbed so that every tensor counts. Import it (any TP),
run it: the logits are transformers'; export it again: the files are bitwise the same.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import transformers
from dist_helpers import run_distributed
from helpers import ROOT

from mp_offload import parallel_state as ps
from mp_offload.checkpoint import ConversionError, FullTensors, resolve_checkpoint
from mp_offload.checkpoint.convert import main as convert
from mp_offload.checkpoint.hf_gpt2 import check_gpt2_compatible, gpt2_name_map
from mp_offload.checkpoint.hf_llama import check_llama_compatible, llama_name_map
from mp_offload.checkpoint.safetensors_io import SafeTensorsFile
from mp_offload.generation import load_model
from mp_offload.model.gpt import GPTConfig
from mp_offload.tensor_parallel import gather_from_tp_region

VOCAB, HIDDEN, HEADS, POS = 100, 64, 8, 32
# name -> LlamaConfig overrides: GQA (G < a), MHA (G = a), one K/V head (G = 1), a tied
# head with biases, and Llama 3's rope base.
CASES = {
    "gqa": dict(num_key_value_heads=2),
    "mha": dict(num_key_value_heads=HEADS),
    "one_kv_head": dict(num_key_value_heads=1),
    "tied_biased": dict(
        num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True
    ),
    "theta_500k": dict(num_key_value_heads=2, rope_theta=500000.0),
}


def make_hf_llama(path, seed=0, **overrides) -> "transformers.LlamaForCausalLM":
    """A random LlamaForCausalLM saved at ``path`` (safetensors + config.json)."""
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        max_position_embeddings=POS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    kw.update(overrides)
    theta = kw.pop("rope_theta", 10000.0)
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    with torch.no_grad():  # HF sets norms to 1 and biases to 0: make every tensor count
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_llama")
    return {
        name: (str(root / name), make_hf_llama(root / name, seed=i, **kw))
        for i, (name, kw) in enumerate(CASES.items())
    }


def _tokens(n=3, s=20, seed=1):
    return torch.randint(0, VOCAB, (n, s), generator=torch.Generator().manual_seed(seed))


def _import(hf_dir, save, tp):
    assert (
        convert(
            [
                "--hf-in",
                hf_dir,
                "--save",
                save,
                "--tensor-model-parallel-size",
                str(tp),
                "--make-vocab-size-divisible-by",
                "16",
            ]
        )
        == 0
    )
    return resolve_checkpoint(save)


# ------------------------------------------------------------------- round trip
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_bitwise_and_loads_cleanly(hf_models, tmp_path, case):
    hf_dir, model = hf_models[case]
    tp = 1 if case == "one_kv_head" else 2
    ckpt = _import(hf_dir, str(tmp_path / "ck"), tp)
    cfg = FullTensors(ckpt).config
    assert cfg.kv_groups == model.config.num_key_value_heads
    assert cfg.padded_vocab_size(tp) > VOCAB  # padding rows exist, and must be cut
    out = str(tmp_path / "hf")
    assert convert(["--load", ckpt, "--hf-out", out]) == 0
    a = SafeTensorsFile(os.path.join(hf_dir, "model.safetensors"))
    b = SafeTensorsFile(os.path.join(out, "model.safetensors"))
    assert sorted(a.names) == sorted(b.names)
    for n in a.names:
        assert torch.equal(a.get(n), b.get(n)), n
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    for key in (
        "num_key_value_heads",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "rms_norm_eps",
        "intermediate_size",
        "max_position_embeddings",
        "vocab_size",
        "rope_parameters",
        "head_dim",
    ):
        assert getattr(loaded.config, key) == getattr(model.config, key), key
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    assert written["rope_theta"] == model.config.rope_parameters["rope_theta"]  # 4.x reads it


# ----------------------------------------------------------------------- logits
@pytest.mark.parametrize("case", list(CASES))
def test_tp1_logits_equal_transformers(hf_models, tmp_path, case):
    hf_dir, model = hf_models[case]
    ckpt = _import(hf_dir, str(tmp_path / "ck"), 1)
    tokens = _tokens()
    with torch.no_grad():
        want = model(tokens).logits
        got = load_model(ckpt)(tokens)
    assert got.shape[-1] == 112  # padded to 16: the padding never reaches a prediction
    torch.testing.assert_close(got[..., :VOCAB], want, atol=1e-4, rtol=0)


def _tp2_logits_worker(rank, world, hf_dir, ckpt, case):
    ps.initialize_model_parallel(2)
    model = load_model(ckpt, ps.get_tensor_model_parallel_group())
    tokens = _tokens()
    with torch.no_grad():
        got = gather_from_tp_region(model(tokens), model.tp_group)[..., :VOCAB]
        want = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(
            tokens
        ).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=lambda m: f"{case}: {m}")
    dist.barrier()


@pytest.mark.slow
def test_tp2_logits_equal_transformers(hf_models, tmp_path):
    for case in ("gqa", "mha", "tied_biased"):
        hf_dir, _ = hf_models[case]
        ckpt = _import(hf_dir, str(tmp_path / case), 2)
        run_distributed(_tp2_logits_worker, 2, hf_dir, ckpt, case)


# ------------------------------------------------------------------- generation
@pytest.mark.slow
def test_generate_tp2_under_torchrun_equals_transformers_greedy(tmp_path):
    """tools/generate.py at TP=2 under torchrun, with a Hugging Face tokenizer.json given
    by flag (an import records none), continues a text prompt with transformers' greedy
    tokens."""
    from mp_offload.data.tokenizer import build_tokenizer
    from mp_offload.data.tokenizer_training import train_bpe_bytelevel

    text = "def parse(text):\n    for line in text.splitlines():\n        yield line\n"
    train_bpe_bytelevel(
        [text.replace("line", w) for w in ("row", "item", "ln")] * 20,
        str(tmp_path / "tok"),
        vocab_size=300,
    )
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tok"))
    # Weights 15x the usual init: at 0.02 a random model repeats one token whatever
    # its MLP does; here the 16 tokens vary and each step's top-2 logits lie far
    # further apart than the two implementations differ.
    hf_dir = str(tmp_path / "hf")
    model = make_hf_llama(
        hf_dir, vocab_size=tok.vocab_size, initializer_range=0.3, num_key_value_heads=2
    )
    ckpt = _import(hf_dir, str(tmp_path / "ck"), 2)
    out = str(tmp_path / "gen.json")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(ROOT, "tools", "generate.py"),
        "--load",
        ckpt,
        "--tensor-model-parallel-size",
        "2",
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(tmp_path / "tok"),
        "--prompt",
        "def parse(",
        "--max-new-tokens",
        "16",
        "--greedy",
        "--ignore-eod",
        "--output-json",
        out,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(out) as f:
        result = json.load(f)
    prompt = tok.tokenize("def parse(")
    assert result["prompt_ids"] == prompt and len(prompt) > 1
    with torch.no_grad():
        theirs = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert len(theirs) == 16 and len(set(theirs)) > 8
    assert result["generated_ids"] == theirs


# --------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "edit,needle",
    [
        (
            dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
            "rope_type 'llama3'",
        ),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(attention_bias=True), "attention_bias != mlp_bias"),
        (dict(head_dim=16), "head_dim 16"),
        (dict(rope_theta=10000.5, rope_parameters=None), "rope_theta 10000.5"),
        (dict(model_type="mistral", architectures=["MistralForCausalLM"]), "'mistral'"),
    ],
)
def test_import_refuses_what_gptmodel_does_not_implement(hf_models, tmp_path, edit, needle):
    src, _ = hf_models["gqa"]
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(edit)
    d = tmp_path / "edited"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    os.symlink(os.path.join(src, "model.safetensors"), d / "model.safetensors")
    from mp_offload.checkpoint import import_hf

    with pytest.raises(ConversionError, match=needle.replace("(", r"\(")) as e:
        import_hf(str(d), str(tmp_path / "ck"), 1)
    assert "\n" not in str(e.value)


def test_import_refuses_a_tp_size_that_splits_a_kv_head(hf_models, tmp_path, capsys):
    hf_dir, _ = hf_models["one_kv_head"]
    assert (
        convert(
            ["--hf-in", hf_dir, "--save", str(tmp_path / "ck"), "--tensor-model-parallel-size", "2"]
        )
        == 1
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--num-query-groups 1" in err, err


LLAMA = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=100,
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    disable_bias_linear=True,
    untie_embeddings_and_output_weights=True,
)


@pytest.mark.parametrize(
    "change,needle",
    [
        (dict(rotary_percent=0.5), "--rotary-percent 0.5"),
        (dict(normalization=None), "--normalization LayerNorm"),
        (dict(swiglu=False), "no --swiglu"),
    ],
)
def test_export_refuses_what_llama_cannot_express(change, needle):
    names = list(llama_name_map(GPTConfig(**LLAMA)))
    check_llama_compatible(dict(LLAMA, sequence_parallel=True, rotary_percent=1.0), names)
    with pytest.raises(ConversionError, match=needle) as e:
        check_llama_compatible(dict(LLAMA, **change), names)
    assert str(e.value).startswith("the model has options LlamaForCausalLM cannot express")
    with pytest.raises(ConversionError, match="output_layer.weight"):
        check_llama_compatible(dict(LLAMA, untie_embeddings_and_output_weights=False), names)


def test_gpt2_export_ignores_training_choices_and_names_flags():
    """Sequence parallelism or recomputation leave a GPT-2 a GPT-2; a Llama option is
    named by its flag."""
    names = list(gpt2_name_map(2))
    cfg = {"num_layers": 2, "hidden_size": 32, "vocab_size": 100}
    check_gpt2_compatible(
        dict(cfg, sequence_parallel=True, recompute_activations=True, normalization="LayerNorm"),
        names,
    )
    with pytest.raises(ConversionError, match="--position-embedding-type rope"):
        check_gpt2_compatible(dict(cfg, position_embedding_type="rope"), names)


# ------------------------------------------------------------------ fine-tuning
def _finetune_worker(rank, world, argv):
    from mp_offload.training import pretrain

    pretrain(argv)


@pytest.mark.slow
def test_finetune_from_an_import_with_the_printed_flags(hf_models, tmp_path):
    """pretrain_gpt.py --finetune takes the import with the flags the converter prints
    (the norm epsilon among them), the rope defaults spelled out (the import stores
    them unset) and sequence parallelism: its first loss is the imported model's loss
    on the first global batch."""
    from mp_offload.data.loader import MockGPTDataset
    from mp_offload.model.gpt_config import model_flags

    hf_dir, _ = hf_models["gqa"]
    save = str(tmp_path / "ck")
    ckpt = _import(hf_dir, save, 2)
    log = str(tmp_path / "ft.jsonl")
    argv = model_flags(FullTensors(ckpt).config) + [
        "--rotary-base",
        "10000",
        "--rotary-percent",
        "1",
        "--vocab-size",
        str(VOCAB),
        "--seq-length",
        "16",
        "--mock-data",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--train-iters",
        "1",
        "--lr",
        "1e-3",
        "--cpu-offload",
        "--load",
        save,
        "--finetune",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--log-json",
        log,
        "--eval-iters",
        "0",
    ]
    run_distributed(_finetune_worker, 2, argv)
    ds = MockGPTDataset(8, 16, VOCAB, 1234)
    batch = torch.stack([torch.from_numpy(ds[i]["text"]) for i in range(8)])
    with torch.no_grad():
        want = load_model(ckpt)(batch[:, :-1], batch[:, 1:]).mean().item()
    with open(log) as f:
        got = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    assert abs(got[0] - want) <= 1e-5 * want, (got, want)


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_the_import_prints_a_complete_finetune_recipe(
    hf_models, tmp_path, capsys, monkeypatch, bbpe_dir, with_tokenizer
):
    """Tokenizer, sequence length and a learning rate: the printed training command is
    accepted by pretrain_gpt.py's checks as it stands, and both commands name the same
    tokenizer (the model's own tokenizer.json when the directory has one)."""
    import shlex
    import shutil

    from mp_offload.config import checked

    hf_dir = str(tmp_path / "hf")
    shutil.copytree(hf_models["gqa"][0], hf_dir)
    if with_tokenizer:
        shutil.copy(os.path.join(bbpe_dir, "tokenizer.json"), hf_dir)
    capsys.readouterr()
    save = str(tmp_path / "ck")
    _import(hf_dir, save, 2)
    lines = capsys.readouterr().out.strip().splitlines()
    commands = [shlex.split(x) for x in lines if x.startswith("  python ")]
    prep, run = commands
    assert prep[:2] == ["python", "tools/preprocess_data.py"]
    flags = run[run.index("pretrain_gpt.py") + 1 :]
    tok = lambda cmd: cmd[cmd.index("--tokenizer-type") : cmd.index("--tokenizer-type") + 4]
    assert tok(prep) == tok(flags)
    want = hf_dir if with_tokenizer else "TOKENIZER_DIR"
    assert tok(flags) == ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", want]
    assert flags[flags.index("--seq-length") + 1] == str(POS)  # the import's
    assert float(flags[flags.index("--lr") + 1]) == 2e-5
    assert flags[flags.index("--load") + 1] == save and "--finetune" in flags
    assert (
        prep[prep.index("--output-prefix") + 1] + "_text_document"
        == (flags[flags.index("--data-path") + 1])
    )
    monkeypatch.setenv("WORLD_SIZE", run[run.index("--nproc-per-node") + 1])
    args, world = checked(flags)
    assert world == 2 and args.parallel.tensor_model_parallel_size == 2
    assert ("no tokenizer.json" in "\n".join(lines)) != with_tokenizer


def test_the_readmes_finetune_recipe_is_what_the_import_prints(hf_models, tmp_path, capsys):
    """The README's five lines and the converter agree, word for word, on everything but
    the paths and what the import fills in."""
    import shlex

    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    blocks = [x for x in readme.split("```")[1::2] if "--hf-in hf_dir" in x and "--finetune" in x]
    lines = blocks[0].split("\n")
    ours = [shlex.split(x) for x in lines if "preprocess_data.py" in x or "--finetune" in x]
    capsys.readouterr()
    _import(hf_models["gqa"][0], str(tmp_path / "ck"), 2)
    out = capsys.readouterr().out.replace(hf_models["gqa"][0], "hf_dir")
    printed = [shlex.split(x) for x in out.splitlines() if x.startswith("  python ")]
    assert ours[0] == [w.replace("TOKENIZER_DIR", "hf_dir") for w in printed[0]]
    tail = lambda cmd: cmd[cmd.index("--data-path") :]
    assert (
        tail(ours[1])[:-4] == [w.replace("TOKENIZER_DIR", "hf_dir") for w in tail(printed[1])][:-4]
    )
