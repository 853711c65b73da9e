"""Pretrain a GPT with tensor parallelism and data-parallel ZeRO-Offload.

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 \
        --micro-batch-size 4 --train-iters 100 --cpu-offload

The loop lives in mp_offload.training; this file only calls it.
"""

import mp_offload.runtime.lifeline  # records the launcher before the slow imports
from mp_offload.config import ConfigError, checked
from mp_offload.runtime.early_exit import finished, refuse

mp_offload.runtime.lifeline.stop_while_starting()  # until the run's own handlers take over

if __name__ == "__main__":
    try:  # a bad flag is one line before torch is imported (seconds; a minute under load)
        checked()
    except ConfigError as e:
        refuse(str(e))
    from mp_offload.training import pretrain

    pretrain()
    finished()
