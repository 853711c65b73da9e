"""Memory planner for TP x ZeRO-Offload GPT runs: ``python -m mp_offload.plan --help``.

    python -m mp_offload.plan --num-layers 50 --hidden-size 4096 --num-attention-heads 32 \
        --seq-length 1024 --bf16 --cpu-offload --recompute-activations \
        --device-memory-gb 32 --host-memory-gb 1536      # per-rank plan + other modes
    python -m mp_offload.plan --machine dgx2 --model llama2-70b  # layout, time, launch line
    python -m mp_offload.plan ... --max-model [--family gpt3|layers]
    python -m mp_offload.plan --paper-table               # the paper's size claims
    python -m mp_offload.plan --throughput [--plot docs/throughput_10b.png]
    pretrain_gpt.py ... --dry-run [--world-size N]        # plan a training command line

This is the command's name only: the planner is mp_offload/planner/ (its package
docstring lists the pieces).
"""

import sys

from .planner.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
