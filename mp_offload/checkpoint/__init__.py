"""Checkpoints: exact resume, resharding to other TP/DP sizes, crash-safe writes, conversions.

Modules, each owning one thing:

- ``on_disk``: the on-disk format (file names, manifest, commit sequence, checked reader,
  vocabulary-padding fit, TP merge of one parameter). Nothing else spells a file name.
- ``save``: the collective save of a training run.
- ``load``: the collective load, re-partitioning the optimizer slices when sizes differ.
- ``offline``: checkpoints in one process for tools: read full tensors, load weights at
  any TP size, write a checkpoint, merge to TP=1.
- ``hf_gpt2``, ``hf_llama``: export to / import from Hugging Face GPT-2 and Llama;
  ``hf`` picks one by the model, ``hf_common`` holds what they share.
- ``safetensors_io``: the safetensors codec.
- ``convert``: the converter's command line (``tools/convert_checkpoint.py``).
- ``guard``: start-up checks of --save (writable, locked, no silent overwrite).
- ``errors``: ``CheckpointError`` and ``ConversionError``.

Design: docs/DESIGN.md (the metadata contract the resharding reads).
"""

from __future__ import annotations

from .errors import CheckpointError, ConversionError
from .guard import SaveLock, check_no_overwrite, check_writable, disk_full_guard, prepare_save
from .hf import export_hf, import_hf
from .load import load_checkpoint
from .offline import (
    FullTensors,
    load_weights_resharded,
    merge_checkpoint,
    resolve_checkpoint,
    write_checkpoint,
)
from .on_disk import (
    FORMAT_VERSION,
    find_checkpoint,
    iter_dir,
    list_iterations,
    read_latest,
)
from .save import save_checkpoint

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "ConversionError",
    "FullTensors",
    "SaveLock",
    "check_no_overwrite",
    "check_writable",
    "export_hf",
    "find_checkpoint",
    "import_hf",
    "disk_full_guard",
    "iter_dir",
    "list_iterations",
    "load_checkpoint",
    "load_weights_resharded",
    "merge_checkpoint",
    "prepare_save",
    "read_latest",
    "resolve_checkpoint",
    "save_checkpoint",
    "write_checkpoint",
]
