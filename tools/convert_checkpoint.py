#!/usr/bin/env python
"""Convert mp_offload checkpoints: merge to TP=1, export to / import from Hugging Face
(GPT2LMHeadModel, or LlamaForCausalLM for a model with rotary positions).

    python tools/convert_checkpoint.py --load ckpt --save-merged ckpt_tp1
    python tools/convert_checkpoint.py --load ckpt --hf-out hf_dir
    python tools/convert_checkpoint.py --hf-in hf_dir --save out --tensor-model-parallel-size 2

Thin wrapper: the logic lives in mp_offload.checkpoint.convert (run --help for the flags).
"""

import sys

from mp_offload.checkpoint.convert import main

if __name__ == "__main__":
    sys.exit(main())
