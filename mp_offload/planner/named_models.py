"""Published model shapes (``--model NAME``) and how the recipes that train them fit.

``--paper-table`` prints, after the largest-model search, one line per recipe
configuration: the device and host peaks of the named model on the hardware its
script targets, planned exactly as ``python -m mp_offload.plan --model NAME ...`` plans it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# What ``torch.cuda.get_device_properties(i).total_memory`` reports, in MiB: less than the
# marketing "GB" (ECC and the driver's own reservation). Sources: the totals in PyTorch's
# out-of-memory messages ("GPU 0 has a total capacity of ... GiB") and printed device
# properties, as posted in public issue threads and logs: H100 80GB HBM3 (SXM) 81559 MiB
# = 85,520,809,984 B = 79.65 GiB; H200 143156 MiB (139.80 GiB; the lent H200 says "about
# 139 GiB"); A100 80GB 81049 MiB (79.15 GiB); A100 40GB 40339 MiB (39.39 GiB, deviceQuery
# on driver 535); V100 32GB 32510 MiB (31.75 GiB); RTX 4090 24563 MiB (23.99 GiB).
GPU_MEMORY_MIB = {
    "H100-80GB": 81559,
    "H200-141GB": 143156,
    "A100-80GB": 81049,
    "A100-40GB": 40339,
    "V100-32GB": 32510,
    "RTX4090-24GB": 24563,
}


def device_memory_gib(gpu: str) -> float:
    """The device memory a GPU really reports, GiB (the planner's unit), rounded down to
    0.01 GiB: a plan never counts memory the device does not have."""
    return math.floor(GPU_MEMORY_MIB[gpu] / 1024 * 100) / 100


def _memory(gpu: str) -> list[str]:
    return ["--device-memory-gb", f"{device_memory_gib(gpu):g}"]


# ``--model NAME``: the flags of a published shape, given before the command line's own
# (argparse keeps the last value, so an explicit flag still wins). Shapes from the public
# model cards and configs (layers, width, FFN width, heads, K/V heads, vocabulary,
# context, rope base): Llama 2 (Touvron et al. 2023, Table 1 and the HF configs), Llama 3
# (Meta's model cards and configs), GPT-2 (Radford et al. 2019, Table 2; 1024 context).
_LLAMA = [
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]


def _shape(layers, hidden, heads, vocab, seq, ffn=None) -> list[str]:
    flags = ["--num-layers", layers, "--hidden-size", hidden, "--num-attention-heads", heads]
    flags += ["--ffn-hidden-size", ffn] if ffn else []
    flags += ["--vocab-size", vocab, "--seq-length", seq, "--max-position-embeddings", seq]
    return [str(f) for f in flags]


def _llama(layers, hidden, ffn, heads, kv_heads, vocab, seq, rope_base) -> list[str]:
    gqa = ["--group-query-attention", "--num-query-groups", str(kv_heads)]
    return [
        *_LLAMA,
        *(gqa if kv_heads < heads else []),  # as many K/V heads as heads: plain attention
        *_shape(layers, hidden, heads, vocab, seq, ffn),
        "--rotary-base",
        str(rope_base),
    ]


MODEL_PRESETS = {
    "llama2-7b": _llama(32, 4096, 11008, 32, 32, 32000, 4096, 10000),
    "llama2-13b": _llama(40, 5120, 13824, 40, 40, 32000, 4096, 10000),
    "llama2-70b": _llama(80, 8192, 28672, 64, 8, 32000, 4096, 10000),
    "llama3-8b": _llama(32, 4096, 14336, 32, 8, 128256, 8192, 500000),
    "llama3-70b": _llama(80, 8192, 28672, 64, 8, 128256, 8192, 500000),
    # Qwen3 14B (its HF config: 40 x 5120, FFN 17408, 40 heads of 128 in 8 K/V groups,
    # vocabulary 151936, rope base 1e6, untied). This model has no QK-norm: 10,240 of its
    # 14,768,307,200 parameters are left out. Planned at seq 4096 (give --seq-length).
    "qwen3-14b": _llama(40, 5120, 17408, 40, 8, 151936, 4096, 1000000),
    # GPT-2: LayerNorm, GELU, learned positions, tied embeddings, biases (the defaults)
    "gpt2": _shape(12, 768, 12, 50257, 1024),
    "gpt2-medium": _shape(24, 1024, 16, 50257, 1024),
    "gpt2-large": _shape(36, 1280, 20, 50257, 1024),
    "gpt2-xl": _shape(48, 1600, 25, 50257, 1024),
}

_V100_NODE = [*_memory("V100-32GB"), "--host-memory-gb", "1536"]


@dataclass
class Recipe:
    model: str
    hardware: str  # a label
    world: int
    flags: list[str]  # training flags after the preset, and planner hardware flags


# What scripts/pretrain_llama3_8b_1gpu_offload.sh and pretrain_llama2_70b_dgx2.sh run.
_8B = [
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "16",
    "--bf16",
    "--cpu-offload",
    "--recompute-activations",
]
_70B = [
    "--tensor-model-parallel-size",
    "8",
    "--sequence-parallel",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "64",
    "--cpu-offload",
    "--recompute-activations",
]
RECIPES = [
    Recipe(
        "llama3-8b",
        "1x 80GB GPU, 256 GiB host",
        1,
        [*_8B, *_memory("H100-80GB"), "--host-memory-gb", "256"],
    ),
    Recipe(
        "llama3-8b",
        "1x 80GB GPU, 256 GiB host",
        1,
        [
            *_8B,
            "--accumulate-grads-on-device",
            "--exp-avg-dtype",
            "bf16",
            "--exp-avg-sq-dtype",
            "bf16",
            *_memory("H100-80GB"),
            "--host-memory-gb",
            "256",
        ],
    ),
    Recipe(
        "llama3-8b",
        "1x V100-32GB, 1.5 TB host",
        1,
        [
            *_8B[:-3],
            "--fp16",
            "--cpu-offload",
            "--recompute-activations",
            "--seq-length",
            "4096",
            "--max-position-embeddings",
            "4096",
            *_V100_NODE,
        ],
    ),
    Recipe(
        "llama2-70b",
        "DGX-2: 16x V100-32GB, 1.5 TB",
        16,
        [*_70B, "--fp16", *_V100_NODE, "--devices-per-node", "16"],
    ),
    Recipe(
        "llama2-70b",
        "DGX-2: 16x V100-32GB, 1.5 TB",
        16,
        [
            *_70B,
            "--fp16",
            "--exp-avg-dtype",
            "bf16",
            "--exp-avg-sq-dtype",
            "bf16",
            *_V100_NODE,
            "--devices-per-node",
            "16",
        ],
    ),
]


def recipe_label(r: Recipe) -> str:
    flags = r.flags
    parts = [
        f"TP={flags[flags.index('--tensor-model-parallel-size') + 1]}"
        if "--tensor-model-parallel-size" in flags
        else "TP=1"
    ]
    every = MODEL_PRESETS[r.model] + flags  # the last value wins, as in argparse
    seq = len(every) - 1 - every[::-1].index("--seq-length")
    parts.append(f"seq {every[seq + 1]}")
    parts += ["SP"] if "--sequence-parallel" in flags else []
    parts += ["device accum."] if "--accumulate-grads-on-device" in flags else []
    parts += ["bf16 m/v"] if "--exp-avg-dtype" in flags else []
    return ", ".join(parts)


# ``--machine NAME``: the hardware flags of a machine, given before the command line's own.
# Device memory is what the device reports (above); bandwidths are the public
# specifications; "sustained" TFLOPS and the achieved link speeds are assumptions (about
# 40% of dense bf16 peak on large GEMMs, PCIe 5 x16 at ~50 GB/s, NCCL bus bandwidth over
# NVLink 4 at ~350 GB/s; PCIe 4 at ~25 GB/s and NVLink 3 at ~230 GB/s on the A100). Without
# --machine the throughput model is the paper's DGX-2 (throughput.Machine's defaults).
_HGX = [
    "--devices-per-node",
    "8",
    "--tp-devices-per-node",
    "8",
    "--host-memory-gb",
    "2048",
    "--device-tflops",
    "400",
    "--intra-node-gbs",
    "350",
    "--inter-node-gbs",
    "40",
    "--pcie-gbs",
    "50",
    "--cpu-cores-per-node",
    "112",
    "--host-mem-gbs",
    "400",
]
_DGX_A100 = [
    *["--devices-per-node", "8", "--tp-devices-per-node", "8", "--host-memory-gb", "2048"],
    *["--device-tflops", "125", "--intra-node-gbs", "230", "--inter-node-gbs", "25"],
    *["--pcie-gbs", "25", "--cpu-cores-per-node", "128", "--host-mem-gbs", "300"],
    *["--device-mem-gbs", "2039"],
]


MACHINE_PRESETS = {
    "dgx2": [
        "--devices-per-node",
        "16",
        "--tp-devices-per-node",
        "16",
        *_memory("V100-32GB"),
        "--host-memory-gb",
        "1536",
    ],
    "dgx-a100": [*_DGX_A100, *_memory("A100-80GB")],
    "hgx-h100": [*_HGX, *_memory("H100-80GB"), "--device-mem-gbs", "3350"],
    "hgx-h200": [*_HGX, *_memory("H200-141GB"), "--device-mem-gbs", "4800"],
}


def _one_gpu(gpu: str, tflops: int, mem_gbs: int, pcie_gbs: int, cores: int) -> list[str]:
    """A single-GPU machine; host memory stays the planner's default (give the flag)."""
    return [
        *["--devices-per-node", "1", "--tp-devices-per-node", "1", *_memory(gpu)],
        *["--device-tflops", str(tflops), "--device-mem-gbs", str(mem_gbs)],
        *["--pcie-gbs", str(pcie_gbs), "--intra-node-gbs", str(pcie_gbs)],
        *["--cpu-cores-per-node", str(cores), "--host-mem-gbs", "100"],
    ]


# One GPU in a workstation or a cloud slice: the same 40% of dense bf16 peak (RTX 4090:
# of its 82.6 TFLOPS with fp32 accumulation), PCIe 5 (H100) or 4 (the others).
MACHINE_PRESETS.update(
    {
        "h100": _one_gpu("H100-80GB", 400, 3350, 50, 16),
        "a100-80gb": _one_gpu("A100-80GB", 125, 2039, 25, 16),
        "a100-40gb": _one_gpu("A100-40GB", 125, 1555, 25, 16),
        "rtx4090": _one_gpu("RTX4090-24GB", 33, 1008, 25, 16),
        # The H200 lent to this project: 16 cores, 128 GiB of host memory, and pinned copies
        # measured at about 25 GB/s one way and 11-16 GB/s each way when both run at once.
        "h200": [
            *_one_gpu("H200-141GB", 400, 4800, 25, 16),
            *["--pcie-duplex-gbs", "13.5", "--host-memory-gb", "128"],
        ],
    }
)
# Machines whose GPUs have no bf16 (compute capability below 8.0): planned in fp16, as
# their launch scripts run them (scripts/pretrain_llama2_70b_dgx2.sh).
NO_BF16 = {"dgx2": "V100s"}
# The GPU each machine's speed is priced for, as the output names it.
MACHINE_GPUS = {
    "h100": "1x H100-80GB",
    "a100-80gb": "1x A100-80GB",
    "a100-40gb": "1x A100-40GB",
    "rtx4090": "1x RTX 4090-24GB",
    "h200": "1x H200-141GB (the lent machine's PCIe)",
    "dgx2": "16x V100-32GB (DGX-2)",
    "dgx-a100": "8x A100-80GB (DGX A100)",
    "hgx-h100": "8x H100-80GB SXM (HGX H100)",
    "hgx-h200": "8x H200-141GB SXM (HGX H200)",
}
