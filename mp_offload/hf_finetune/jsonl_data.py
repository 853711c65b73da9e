"""Fine-tuning data from JSONL, tokenized by the model's own tokenizer.

A file holds one of three formats, told by its first line; every line must have that
format's keys:

* ``{"text": ...}``: documents, each followed by EOS, packed into ``seq_length`` blocks;
  every token is a target.
* ``{"prompt": ..., "completion": ...}``: one example per line; only the completion
  (and the EOS after it) are targets.
* ``{"messages": [{"role", "content"}, ...]}``: rendered by the tokenizer's chat
  template; only the assistant turns are targets.

Labels follow Hugging Face: the same length as the inputs, -100 where there is no
target, shifted inside the model. ``GlobalBatches`` orders the examples by a seeded
permutation per epoch and gives each data-parallel rank its own contiguous share of
every global batch, so the order depends only on the seed and the sample count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from . import BadInput

IGNORE = -100  # the label of a token that is no target (torch's cross-entropy default)
FORMATS = {"text": ("text",), "prompt": ("prompt", "completion"), "messages": ("messages",)}


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]

    @property
    def targets(self) -> int:
        """Tokens the loss counts (the first label is never predicted)."""
        return sum(t != IGNORE for t in self.labels[1:])


def read_jsonl(path: str) -> tuple[str, list[dict]]:
    """(the format, the records) of ``path``; a line that is not a JSON object with the
    format's keys, as strings, is a BadInput naming the file and the line."""
    records, kind = [], None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"--data {path}:{number}"
            try:
                rec = json.loads(line.strip())
            except json.JSONDecodeError as e:
                raise BadInput(f"{where}: not JSON ({e.msg} at character {e.pos + 1})") from None
            if not isinstance(rec, dict):
                raise BadInput(f"{where}: a line must be a JSON object")
            kind = kind or next((k for k in FORMATS if k in rec), None)
            if kind is None:
                raise BadInput(
                    f"{where}: no key of any format {sorted(map(list, FORMATS.values()))}"
                )
            _check_record(rec, kind, where)
            records.append(rec)
    if not records:
        raise BadInput(f"--data {path}: the file holds no JSON lines")
    return kind, records


def _check_record(rec: dict, kind: str, where: str) -> None:
    for key in FORMATS[kind]:
        if key not in rec:
            raise BadInput(f'{where}: no "{key}" (the file\'s first line is {kind!r} format)')
    if kind != "messages":
        bad = [k for k in FORMATS[kind] if not isinstance(rec[k], str)]
        if bad:
            raise BadInput(f'{where}: "{bad[0]}" must be a string')
        return
    msgs = rec["messages"]
    ok = isinstance(msgs, list) and msgs and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in msgs
    )  # fmt: skip
    if not ok:
        raise BadInput(f'{where}: "messages" must be a list of {{"role", "content"}} strings')


def _encode(tokenizer, text: str, special: bool = False) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def _eos(tokenizer) -> list[int]:
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


def _pack_text(records: list[dict], tokenizer, seq_length: int) -> list[Example]:
    stream = []
    for rec in records:
        stream += _encode(tokenizer, rec["text"], special=True) + _eos(tokenizer)
    blocks = [stream[i : i + seq_length] for i in range(0, len(stream), seq_length)]
    return [Example(b, list(b)) for b in blocks if len(b) > 1]


def _prompt_completion(rec: dict, tokenizer) -> Example:
    prompt = _encode(tokenizer, rec["prompt"], special=True)
    completion = _encode(tokenizer, rec["completion"]) + _eos(tokenizer)
    return Example(prompt + completion, [IGNORE] * len(prompt) + completion)


def _chat(rec: dict, tokenizer, where: str) -> Example:
    """Each assistant turn's text is its target; everything the template puts before it
    (the turns so far and the generation prompt) is context. Rendered turn by turn, so
    each piece's tokens are known without offsets."""
    msgs = rec["messages"]
    render = (
        lambda upto, prompt: tokenizer.apply_chat_template(  # noqa: E731
            msgs[:upto], tokenize=False, add_generation_prompt=prompt
        )
    )
    ids, labels, done = [], [], ""
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before, through = (render(i, True) if i else ""), render(i + 1, False)
        if not (before.startswith(done) and through.startswith(before)):
            raise BadInput(
                f"{where}: the tokenizer's chat template does not render this conversation "
                "turn by turn (an earlier rendering is not a prefix of a later one)"
            )
        context, target = (
            _encode(tokenizer, before[len(done) :]),
            _encode(tokenizer, through[len(before) :]),
        )
        ids += context + target
        labels += [IGNORE] * len(context) + target
        done = through
    return Example(ids, labels)


def tokenize(path: str, tokenizer, seq_length: int) -> tuple[str, list[Example], int]:
    """(the format, the examples cut to ``seq_length``, how many were dropped for having
    no target left) of the JSONL file ``path``."""
    kind, records = read_jsonl(path)
    if kind == "messages" and not getattr(tokenizer, "chat_template", None):
        raise BadInput(f'--data {path}: "messages" lines need a tokenizer with a chat template')
    if kind == "text":
        examples = _pack_text(records, tokenizer, seq_length)
    elif kind == "prompt":
        examples = [_prompt_completion(r, tokenizer) for r in records]
    else:
        examples = [_chat(r, tokenizer, f"--data {path}:{n}") for n, r in enumerate(records, 1)]
    cut = [Example(e.input_ids[:seq_length], e.labels[:seq_length]) for e in examples]
    kept = [e for e in cut if e.targets > 0]
    if not kept:
        raise BadInput(
            f"--data {path}: no example keeps a target token within --seq-length {seq_length}"
        )
    return kind, kept, len(cut) - len(kept)


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """One micro-batch, right-padded to its longest example."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE)
    mask = torch.zeros_like(ids)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        mask[row, :n] = 1
    return dict(input_ids=ids, labels=labels, attention_mask=mask)


class GlobalBatches:
    """Which examples make each global batch, and this rank's micro-batches of it.

    Sample ``s`` of the run (counting from 0 over all iterations) is example
    ``perm_e[s % n]`` of epoch ``e = s // n``, ``perm_e`` a permutation seeded by
    ``seed + e``. Global batch ``i`` is samples ``[consumed, consumed + global_batch)``;
    rank ``r`` takes the ``r``-th contiguous share of it, cut into micro-batches.
    """

    def __init__(self, n: int, global_batch: int, micro_batch: int, world: int, rank: int,
                 seed: int):  # fmt: skip
        self.n, self.global_batch, self.micro_batch = n, global_batch, micro_batch
        self.world, self.rank, self.seed = world, rank, seed
        self._perms: dict[int, list[int]] = {}

    def _example(self, sample: int) -> int:
        epoch = sample // self.n
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g).tolist()}
        return self._perms[epoch][sample % self.n]

    def global_batch_at(self, consumed: int) -> list[int]:
        return [self._example(s) for s in range(consumed, consumed + self.global_batch)]

    def micro_batches_at(self, consumed: int) -> list[list[int]]:
        share = self.global_batch // self.world
        mine = self.global_batch_at(consumed)[self.rank * share : (self.rank + 1) * share]
        return [mine[i : i + self.micro_batch] for i in range(0, share, self.micro_batch)]
