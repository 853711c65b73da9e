"""The tiny GPT the tests train, its Adam settings, the repository root and the tool
loader, in one place.

Importable from test modules and from the ranks they spawn (conftest.py puts tests/ on
sys.path). Tests that need another size pass it as an override, so each test's model
stays visible at its call site.
"""

from __future__ import annotations

import importlib.util
import os

#: the repository's root (tests run scripts and tools from there).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: the limit of a quick subprocess (a torch import, a refusal): a guard against a hang, not a
#: speed test, so far above its time on a loaded machine (a torch import alone took minutes
#: at load 18 on 2 cores).
HANG_TIMEOUT = 600

_TINY_GPT = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=96,
    make_vocab_size_divisible_by=8,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)

#: ZeroOptimizer keywords (and the torch AdamW reference's) of the optimizer tests.
ADAM_HP = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=0.5)


def tiny_gpt_config(**overrides) -> dict:
    """GPTConfig keywords of the tiny GPT: 2 layers, hidden 32, 4 heads, sequence 16,
    vocabulary 96 padded to a multiple of 8, no dropout. An override of None drops the
    key, so GPTConfig's default applies."""
    cfg = dict(_TINY_GPT, **overrides)
    return {k: v for k, v in cfg.items() if v is not None}


def tiny_model_flags(**overrides) -> list[str]:
    """The same model as pretrain_gpt.py flags (``hidden_size`` -> ``--hidden-size``);
    overrides as for ``tiny_gpt_config``, a boolean one is a switch."""
    flags = []
    for key, value in tiny_gpt_config(**overrides).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        else:
            flags += [flag, format(value, "g") if isinstance(value, float) else str(value)]
    return flags


def load_tool(name: str):
    """``tools/<name>.py`` as a module: the tools are scripts, not a package."""
    path = os.path.join(ROOT, "tools", name + ".py")
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: pretrain_gpt.py flags of the resume/reshard tests: the tiny GPT (vocabulary 100), mock
#: data, 8 iterations with evaluation every 3, offload, buckets small enough for several.
CKPT_RUN = tiny_model_flags(vocab_size=100) + [
    "--mock-data",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "3e-3",
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


def micro_batches(tokens, micro: int):
    """The rows of ``tokens`` [n, seq+1], ``micro`` at a time, as ``training.train_step``
    takes a step's batches (the test loops call it: what they check is what trains)."""
    return iter(tokens.split(micro))
