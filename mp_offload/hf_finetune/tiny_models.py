"""Tiny random Hugging Face models with their own small tokenizer, built locally.

``write_model_dir`` writes what ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` read (config, optionally random weights, a byte-level
BPE trained on the given texts with a ChatML chat template): the examples, the tests and
the benchmark fine-tune these, and nothing is downloaded.
"""

from __future__ import annotations

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(texts: list[str], vocab_size: int = 320):
    """A byte-level BPE over ``texts`` (every byte encodes), EOS ``<|endoftext|>`` (also
    the padding), and the ChatML template."""
    import tokenizers as tk
    from transformers import PreTrainedTokenizerFast

    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=SPECIAL[0],
        bos_token=SPECIAL[0],
        pad_token=SPECIAL[0],
        chat_template=CHATML,
    )


def tiny_config(arch: str, vocab_size: int, hidden: int = 32, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, ffn: int | None = None, positions: int = 256):  # fmt: skip
    """A small config of ``arch`` ("gpt2", "llama", "qwen2", "mistral", "gpt_neox")."""
    from transformers import AutoConfig

    ffn = ffn or 4 * hidden
    if arch == "gpt2":
        kw = dict(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=ffn, n_positions=positions)
    elif arch == "gpt_neox":
        kw = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=ffn, max_position_embeddings=positions)  # fmt: skip
    else:
        kw = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, intermediate_size=ffn,
                  max_position_embeddings=positions)  # fmt: skip
    return AutoConfig.for_model(
        arch, vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=0, **kw
    )


def write_model_dir(out_dir: str, arch: str, texts: list[str], *, weights: bool = True,
                    seed: int = 0, vocab_size: int = 320, **sizes) -> str:  # fmt: skip
    """A model directory for ``arch`` in ``out_dir``: tokenizer trained on ``texts``, config,
    and (``weights``) random weights from ``seed``; returns ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = make_tokenizer(texts, vocab_size)
    config = tiny_config(arch, len(tokenizer), **sizes)
    tokenizer.save_pretrained(out_dir)
    if not weights:
        config.save_pretrained(out_dir)
        return out_dir
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return out_dir


def arithmetic_pairs(n: int, seed: int = 0) -> list[dict]:
    """``n`` prompt/completion records a tiny model learns quickly (sums of small numbers,
    written out), for the examples and tests."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        out.append(dict(prompt=f"{a} plus {b} is", completion=f" {a + b}."))
    return out
