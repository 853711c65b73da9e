"""Sampling text from a trained checkpoint at any TP size; ``tools/generate.py`` calls ``main``.

Each step runs the whole (left-truncated) context through the model — no KV cache, which
is fine at these model sizes — gathers the vocabulary-parallel logits of the last
position, masks the padded vocabulary, and picks one token. Every TP rank computes the
same full logits; TP rank 0's choice is broadcast anyway, so the ranks can never drift
apart (e.g. through a non-deterministic kernel on one GPU).

    torchrun --nproc-per-node 2 tools/generate.py --tensor-model-parallel-size 2 \
        --load ckpt --prompt "def main(" --max-new-tokens 64 --top-p 0.9
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from . import parallel_state as ps
from .checkpoint import (
    CheckpointError,
    FullTensors,
    load_weights_resharded,
    resolve_checkpoint,
)
from .checkpoint.on_disk import tokenizer_args
from .config.help import DefaultsHelpFormatter
from .data.tokenizer import TOKENIZER_TYPES, tokenizer_for
from .model.gpt import GPTModel
from .paths import closest_existing
from .runtime.distributed import first_error, is_reporting_rank
from .runtime.early_exit import say, wait_for_the_launcher
from .tensor_parallel import gather_from_tp_region
from .tensor_parallel.utils import TP_ATTRIBUTES


def sample_token(
    logits: torch.Tensor,
    vocab_size: int,
    *,
    greedy: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """One token id from full (padded) logits [padded_vocab]; ids >= vocab_size never."""
    logits = logits.detach().float().cpu().clone()
    logits[vocab_size:] = float("-inf")  # padding rows are zero, their logit is not -inf
    if greedy or temperature <= 0:
        return int(torch.argmax(logits))
    logits /= temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, vocab_size)).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        order = torch.argsort(logits, descending=True)
        probs = torch.softmax(logits[order], dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the better tokens
        logits[order[before >= top_p]] = float("-inf")  # the best token always stays
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _agree(token: int, group: ps.ParallelGroup, device) -> int:
    """TP rank 0's token on every rank of the group."""
    if group.size == 1:
        return token
    t = torch.tensor([token], dtype=torch.int64, device=device)
    pg = group.torch_group()
    dist.broadcast(t, dist.get_global_rank(pg, 0), group=pg)
    return int(t.item())


@torch.no_grad()
def generate(
    model: GPTModel,
    prompt: list[int],
    max_new_tokens: int,
    *,
    eod: int | None = None,
    generator: torch.Generator | None = None,
    **sampling,
) -> list[int]:
    """The new token ids after ``prompt`` (stops early at ``eod`` when given)."""
    if not prompt:
        raise ValueError("empty prompt (and no end-of-document token to start from)")
    model.eval()
    device = next(model.parameters()).device
    cfg, tokens = model.cfg, list(prompt)
    for _ in range(max_new_tokens):
        # Learned positions stop at max_position_embeddings: keep only the newest tokens.
        ctx = torch.tensor([tokens[-cfg.max_position_embeddings :]], device=device)
        local = model(ctx)[:, -1]  # [1, padded_vocab / tp]
        full = gather_from_tp_region(local, model.tp_group)[0]
        token = _agree(
            sample_token(full, cfg.vocab_size, generator=generator, **sampling),
            model.tp_group,
            device,
        )
        tokens.append(token)
        if eod is not None and token == eod:
            break
    return tokens[len(prompt) :]


def load_model(
    ckpt: str, tp_group: ps.ParallelGroup | None = None, dtype=torch.float32, device="cpu"
) -> GPTModel:
    """A GPTModel holding the checkpoint's weights, split for ``tp_group`` (default: one
    process)."""
    tp_group = tp_group or ps.ParallelGroup.single()
    cfg = FullTensors(ckpt).config
    cfg.recompute_activations = False
    cfg.sequence_parallel = False  # contexts of any length, not multiples of the TP size
    # Built on the meta device (no random init), then given storage and the weights.
    model = GPTModel(cfg, tp_group=tp_group, dtype=dtype, device="meta")
    meta = {n: p for n, p in model.named_parameters()}
    model.to_empty(device=device)
    for n, p in model.named_parameters():  # to_empty may make new Parameter objects
        for a in TP_ATTRIBUTES:
            setattr(p, a, getattr(meta[n], a))
    load_weights_resharded(ckpt, model)
    return model.eval()


class TextSampler:
    """``--sample-prompt``: a short greedy continuation, printed at each evaluation and at
    the end of the run, with the run's own tokenizer (not ``data.PretrainingSampler``,
    which picks the training samples).

    Every rank takes part: ``generate`` gathers the vocabulary-parallel logits over the
    TP group and broadcasts TP rank 0's token, so the ranks of a TP group stay in step;
    each DP replica computes the same text and global rank 0 prints it. Greedy, so no
    random numbers are drawn and training is unchanged by it.
    """

    def __init__(self, tokenizer, stops_at_eod: bool, text: str, tokens: int):
        self.tok = tokenizer
        try:
            ids = tokenizer.tokenize(text) if text else []
        except ValueError as e:
            raise ValueError(f"--sample-prompt {text!r}: {e}") from None
        self.prompt, self.show_prompt = (ids, True) if ids else ([tokenizer.eod], False)
        self.eod = tokenizer.eod if stops_at_eod else None
        self.tokens = tokens

    def __call__(self, model, precision) -> str:
        """The text; ``precision``: the run's autocast context (a fresh one per call)."""
        with torch.no_grad(), precision:
            new = generate(model, self.prompt, self.tokens, eod=self.eod, greedy=True)
        model.train()
        # Prompt and continuation decoded together, so pieces join as they should.
        return self.tok.detokenize(self.prompt + new if self.show_prompt else new)


# ------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        description="Sample text from an mp_offload checkpoint "
        "(single process, or torchrun with TP)",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--load", required=True, help="checkpoint root (or an iter_* directory)")
    p.add_argument("--iteration", type=int, help="default: the latest checkpoint")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        help="default: the one saved with the run (an imported Hugging Face "
        "model has none: HuggingFaceTokenizer with its directory)",
    )
    p.add_argument(
        "--tokenizer-model",
        help="SentencePiece model, or tokenizer.json or a "
        "directory holding one (default: the run's)",
    )
    p.add_argument("--vocab-file", help="GPT2BPETokenizer vocab.json (default: the run's)")
    p.add_argument("--merge-file", help="GPT2BPETokenizer merges.txt (default: the run's)")
    p.add_argument("--prompt", default="", help="text to continue (empty: start at EOD)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="always the most likely token")
    mode.add_argument("--top-k", type=int, default=0, help="sample among the k most likely")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample from the smallest set holding this probability mass",
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ignore-eod", action="store_true", help="keep going past end-of-document")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--output-json", help="also write prompt/generated ids and text here")
    return p


def sampling_problem(a) -> str | None:
    """The first sampling flag out of range, as a line naming it (None: all fine)."""
    if not 0 < a.top_p <= 1:
        return f"--top-p must be > 0 and <= 1, got {a.top_p:g}"
    if a.top_k < 0:
        return f"--top-k must be >= 0 (0: no limit), got {a.top_k}"
    if not a.temperature > 0:
        return (
            f"--temperature must be > 0, got {a.temperature:g} (--greedy picks the most "
            f"likely token)"
        )
    if a.max_new_tokens < 0:
        return f"--max-new-tokens must be >= 0, got {a.max_new_tokens}"
    if a.tensor_model_parallel_size < 1:
        return f"--tensor-model-parallel-size must be >= 1, got {a.tensor_model_parallel_size}"
    return None


def _prompt_ids(tok, text: str) -> list[int]:
    """``--prompt`` as ids ([EOD] when empty); a ValueError naming the flag otherwise."""
    if not text:
        return [tok.eod]
    try:
        return tok.tokenize(text)
    except ValueError as e:
        raise ValueError(f"--prompt {text!r}: {e}") from None


def _setup(tp: int):
    """Join torchrun's world when there is one, through the run's own start-up (its
    rendezvous message and timeout); returns (device, created_group)."""
    from .runtime.distributed import DeviceError, RendezvousError, init_distributed, pick_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    created = world > 1 and not dist.is_initialized()
    try:
        device = init_distributed() if created else pick_device()
    except (DeviceError, RendezvousError) as e:
        raise SystemExit(f"generate: {e}") from None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        try:
            ps.initialize_model_parallel(tp)
        except ps.ParallelConfigError as e:  # every rank holds the same sizes
            _refuse(f"generate: {e}")
    elif tp != 1:
        raise SystemExit(
            f"generate: --tensor-model-parallel-size {tp} needs torchrun with "
            f"a multiple of {tp} processes"
        )
    return device, created


def _load(a, device):
    """(checkpoint, model, tokenizer, stops at EOD, prompt ids) on every rank, or one
    SystemExit for all of them: one bad rank must not hang the rest."""
    error, loaded = None, None
    try:
        missing = _load_problem(a.load)
        if missing:
            raise ValueError(missing)
        ckpt = resolve_checkpoint(a.load, a.iteration)
        full = FullTensors(ckpt)
        saved = dict(full.common().get("args", {}), data=tokenizer_args(ckpt, full.common()))
        tok, stops = tokenizer_for(
            saved,
            full.config.vocab_size,
            a.tokenizer_type,
            a.tokenizer_model,
            a.vocab_file,
            a.merge_file,
        )
        if tok.vocab_size != full.config.vocab_size:
            # smaller: the model's other ids would decode as garbage; larger: the prompt
            # could hold ids the model has no embedding for (padding is not counted here)
            raise CheckpointError(
                f"the tokenizer has {tok.vocab_size} ids, the model "
                f"{full.config.vocab_size}: not the tokenizer it was trained with "
                f"(give it with --tokenizer-type/--tokenizer-model/--vocab-file)"
            )
        prompt = _prompt_ids(tok, a.prompt)
        tp = ps.get_tensor_model_parallel_group() if dist.is_initialized() else None
        model = load_model(ckpt, tp, getattr(torch, a.dtype), device)
        loaded = ckpt, model, tok, stops, prompt
    except (CheckpointError, ValueError, OSError) as e:
        error = str(e) if str(e).startswith("--") else f"{type(e).__name__}: {e}"
    error = first_error(error)
    if error:
        _refuse(f"generate: {error}")
    return loaded


def _refuse(msg: str):
    """Stop with ``msg``, which every rank of the job reached, printed once: by a lone
    process as its SystemExit; under torchrun by the reporting rank, while the others
    wait for it (a barrier, or before the process group exists the launcher's stop)."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        raise SystemExit(msg)
    if is_reporting_rank():
        say(msg)
    if dist.is_initialized():
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    else:
        wait_for_the_launcher(1)
    sys.exit(1)


def _load_problem(load: str) -> str | None:
    """--load names nothing: "no such directory", with the closest existing one."""
    if os.path.exists(load):
        return None
    guess = closest_existing(load)
    hint = f"; did you mean {guess}?" if guess else ""
    return f"--load {load}: no such directory{hint}"


def _checked_args(argv) -> argparse.Namespace:
    """The flags, every problem found before loading anything (one line, once per job)."""
    from .config import unknown_flag_problems

    parser = build_parser()
    a, extra = parser.parse_known_args(argv)
    if extra:  # with the closest flag, as pretrain_gpt.py does
        _refuse(f"generate: {unknown_flag_problems(extra, parser)[0]}")
    problem = sampling_problem(a)
    if problem:
        _refuse(f"generate: {problem}")
    if a.greedy and a.top_p < 1.0:
        _refuse("generate: --greedy and --top-p exclude each other")
    out_dir = os.path.dirname(os.path.abspath(a.output_json)) if a.output_json else None
    if out_dir and not os.path.isdir(out_dir):  # found now, not after generating
        _refuse(f"generate: --output-json {a.output_json}: no directory {out_dir}")
    return a


def main(argv=None) -> dict:
    a = _checked_args(argv)
    device, created = _setup(a.tensor_model_parallel_size)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    try:
        ckpt, model, tok, stops, prompt = _load(a, device)
        gen = torch.Generator().manual_seed(a.seed)  # same stream on every rank
        new = generate(
            model,
            prompt,
            a.max_new_tokens,
            generator=gen,
            eod=tok.eod if stops and not a.ignore_eod else None,
            greedy=a.greedy,
            top_k=a.top_k,
            top_p=a.top_p,
            temperature=a.temperature,
        )
        result = {
            "checkpoint": ckpt,
            "prompt": a.prompt,
            "prompt_ids": prompt,
            "generated_ids": new,
            "text": tok.detokenize(new),
        }
        if rank0:
            # Detokenize prompt and continuation together so pieces join as they should.
            print(tok.detokenize(prompt + new) if a.prompt else result["text"], flush=True)
            if a.output_json:
                with open(a.output_json, "w") as f:
                    json.dump(result, f)
        return result
    finally:
        if dist.is_initialized():
            ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
