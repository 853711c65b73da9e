"""Memory planner for TP x ZeRO-Offload GPT runs: ``python -m mp_offload.plan --help``.

    python -m mp_offload.plan --num-layers 50 --hidden-size 4096 --num-attention-heads 32 \
        --seq-length 1024 --bf16 --cpu-offload --recompute-activations \
        --device-memory-gb 32 --host-memory-gb 1536      # per-rank plan + other modes
    python -m mp_offload.plan ... --max-model [--family gpt3|layers]
    python -m mp_offload.plan --paper-table               # the paper's size claims
    python -m mp_offload.plan --throughput [--plot docs/throughput_10b.png]
    pretrain_gpt.py ... --dry-run [--world-size N]        # plan a training command line

The pieces live in mp_offload/planner/: shapes (exact per-rank parameter layout),
activations (the estimate and its formula), memory (categories, modes, fit), search
(largest model, paper table), throughput (step-time model), cli; the --dry-run
adapter is mp_offload/dry_run.py.
"""

import sys

from .planner.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
