#!/usr/bin/env python
"""Sample text from a trained checkpoint, in one process or with TP under torchrun.

    python tools/generate.py --load ckpt --prompt "def f(" --max-new-tokens 40 --greedy
    torchrun --nproc-per-node 2 tools/generate.py --tensor-model-parallel-size 2 \
        --load ckpt --prompt "def f(" --top-p 0.9 --temperature 0.8 --seed 7

Thin wrapper: the logic lives in mp_offload.generation (run --help for the flags).
"""

from mp_offload.generation import main

if __name__ == "__main__":
    main()
