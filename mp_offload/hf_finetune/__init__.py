"""Fine-tuning any local Hugging Face causal LM with ``OffloadAdamW`` (tools/finetune_hf.py).

The reusable pieces: ``jsonl_data`` (the three JSONL formats, completion-only labels,
the data-parallel split of each global batch), ``run_state`` (the run's checkpoints and
the ``save_pretrained`` export), ``tiny_models`` (a tiny random model directory with its
own tokenizer, for the examples, tests and benchmark; nothing is downloaded).
"""


class BadInput(ValueError):
    """A flag, file or line that cannot be used; the message names it (one line)."""
