"""The datasets and batch iterators of one run, from its flags.

Only TP rank 0 of each TP group reads data (its batches are broadcast to the group);
global rank 0 builds the index caches first, then the other readers load them. Every
step that can fail on one rank (a corrupt file, a full disk, data made with another
tokenizer) runs inside ``agreed``: its error is raised on every rank alike, as one
line, instead of one rank's traceback under the others' lost connections.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import parallel_state as ps
from ..runtime.distributed import agreed, set_phase
from ..runtime.logger import log
from .checks import check_token_ids, load_tokenizer, tokenizer_description
from .loader import BatchIterator, MockGPTDataset, SizedPlaceholder
from .tokenizer import tokenizer_for


@dataclass(frozen=True)
class RunData:
    """What the data layer found for a run: its splits (None where empty), its tokenizer
    (for mock data the NullTokenizer of ids as text, with no EOD to stop at) and the
    tokenizer model the run used (the default corpus brings its own)."""

    train: object
    valid: object
    test: object
    tokenizer: object | None  # None: mock data of a one-id vocabulary (no text at all)
    stops_at_eod: bool
    tokenizer_model: str | None
    vocab_size: int


def num_samples(args) -> tuple[int, int, int]:
    t = args.train
    gbs, iters = t.global_batch_size, t.train_iters
    evals = (iters // t.eval_interval + 2) * t.eval_iters * gbs
    return iters * gbs, evals, t.eval_iters * gbs


def _default_corpus(cache: str) -> tuple[list[str], str]:
    """([prefix], tokenizer model) of the embedded corpus; rank 0 builds it first."""
    from .default_corpus import prepare_default_corpus

    agreed(
        lambda: prepare_default_corpus(cache, log=lambda s: log.info(f"[default corpus] {s}")),
        active=dist.get_rank() == 0,
    )
    prefix, model = agreed(lambda: prepare_default_corpus(cache))
    return [prefix], model


def _mock_data(args) -> RunData:
    """Synthetic splits; the tokenizer reads ids as text (one id has no text at all)."""
    d, m, t = args.data, args.model, args.train
    mk = lambda n, k: MockGPTDataset(max(n, 1), m.seq_length, m.vocab_size, t.seed + k)  # noqa
    tok, stops = (None, False)
    if m.vocab_size > 1:
        tok, stops = tokenizer_for({"data": dataclasses.asdict(d)}, m.vocab_size)
    splits = (mk(n, k) for k, n in enumerate(num_samples(args)))
    return RunData(*splits, tok, stops, None, m.vocab_size)


def build_datasets(args, tokenizer=None) -> RunData:
    """The run's data (``RunData``); only global rank 0 builds caches first. ``args`` is
    left as it is: what the data fixes (the vocabulary, the default corpus's tokenizer
    model) is returned for the run's final ``Args``.

    ``tokenizer``: the one preflight loaded for --data-path (else it is loaded here).
    StartupError (the same on every rank) when the data cannot be used.
    """
    d, m, t = args.data, args.model, args.train
    n_train, n_valid, n_test = num_samples(args)
    if d.mock_data:
        return _mock_data(args)
    from .gpt_dataset import build_train_valid_test_datasets

    set_phase("building the datasets")
    cache = d.data_cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "mp_offload")
    data, data_path = d, d.data_path
    if data_path is None:  # the embedded default corpus: the stdlib's own sources
        data_path, model = _default_corpus(cache)
        data = dataclasses.replace(d, data_path=data_path, tokenizer_model=model)
        tokenizer = None
    if tokenizer is None:
        tokenizer = agreed(lambda: load_tokenizer(data, m.vocab_size))
    # One pass over every .bin (cached): ids beyond the vocabulary mean another tokenizer.
    _check_ids(data, data_path, tokenizer, m.vocab_size)
    datasets = (None, None, None)
    is_reader = ps.get_tensor_model_parallel_rank() == 0
    for turn in (0, 1):  # rank 0 builds the index caches, then the other readers load them
        datasets = (
            agreed(
                lambda: build_train_valid_test_datasets(
                    data_path,
                    d.split,
                    (n_train, n_valid, n_test),
                    m.seq_length,
                    t.seed,
                    cache_dir=d.data_cache_dir,
                ),
                active=is_reader and (dist.get_rank() == 0) == (turn == 0),
            )
            or datasets
        )
    # Non-readers hold no datasets: learn from TP rank 0 which splits exist and their
    # lengths (-1: no such split), so every rank can run the same sampler.
    lengths = torch.tensor(
        [-1 if ds is None else len(ds) for ds in datasets],
        dtype=torch.int64,
        device=ps.comm_device(),
    )
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.broadcast(
            lengths,
            ps.get_tensor_model_parallel_src_rank(),
            group=ps.get_tensor_model_parallel_group().torch_group(),
        )
    datasets = tuple(
        ds if is_reader else (None if n < 0 else SizedPlaceholder(n))
        for ds, n in zip(datasets, lengths.tolist())
    )
    return RunData(*datasets, tokenizer, True, data.tokenizer_model, tokenizer.vocab_size)


def _check_ids(data, data_path, tokenizer, vocab_size: int) -> None:
    """Global rank 0 reads the ids (cached) and every rank gets its verdict: an error for
    ids beyond the vocabulary, warning lines for NullTokenizer data of another one."""
    from .gpt_dataset import parse_data_path

    null = data.tokenizer_type == "NullTokenizer"
    warnings = agreed(
        lambda: check_token_ids(
            parse_data_path(data_path)[0],
            tokenizer.vocab_size,
            tokenizer_description(data, vocab_size),
            data.data_cache_dir,
            null_eod=tokenizer.eod if null else None,
        ),
        active=dist.get_rank() == 0,
    )
    for line in warnings or []:
        log.info(line)


def batch_iterator(dataset, args, consumed: int, device):
    """``dataset`` is None when the split is empty (non-readers hold a SizedPlaceholder)."""
    if dataset is None:
        return None
    return BatchIterator(
        dataset,
        consumed,
        args.train.micro_batch_size,
        ps.get_data_parallel_rank(),
        ps.get_data_parallel_world_size(),
        args.model.seq_length,
        device,
        ps.get_tensor_model_parallel_group(),
        ps.get_tensor_model_parallel_src_rank(),
        is_reader=ps.get_tensor_model_parallel_rank() == 0,
    )
