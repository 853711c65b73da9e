"""Published model shapes (``--model NAME``) and how the recipes that train them fit.

``--paper-table`` prints, after the largest-model search, one line per recipe
configuration: the device and host peaks of the named model on the hardware its
script targets, planned exactly as ``python -m mp_offload.plan --model NAME ...`` plans it.
"""

from __future__ import annotations

from dataclasses import dataclass

# ``--model NAME``: the flags of a published shape, given before the command line's own
# (argparse keeps the last value, so an explicit flag still wins). Shapes from the public
# model cards.
_LLAMA = [
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--group-query-attention",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]
MODEL_PRESETS = {
    "llama3-8b": [
        *_LLAMA,
        "--num-layers",
        "32",
        "--hidden-size",
        "4096",
        "--ffn-hidden-size",
        "14336",
        "--num-attention-heads",
        "32",
        "--num-query-groups",
        "8",
        "--vocab-size",
        "128256",
        "--rotary-base",
        "500000",
        "--seq-length",
        "8192",
        "--max-position-embeddings",
        "8192",
    ],
    "llama2-70b": [
        *_LLAMA,
        "--num-layers",
        "80",
        "--hidden-size",
        "8192",
        "--ffn-hidden-size",
        "28672",
        "--num-attention-heads",
        "64",
        "--num-query-groups",
        "8",
        "--vocab-size",
        "32000",
        "--rotary-base",
        "10000",
        "--seq-length",
        "4096",
        "--max-position-embeddings",
        "4096",
    ],
}

_V100_NODE = ["--device-memory-gb", "32", "--host-memory-gb", "1536"]


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
        [*_8B, "--device-memory-gb", "80", "--host-memory-gb", "256"],
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
            "--device-memory-gb",
            "80",
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
# Memory sizes and bandwidths are the public specifications; "sustained" TFLOPS and the
# achieved link speeds are assumptions (about 40% of dense bf16 peak on large GEMMs, PCIe 5
# x16 at ~50 GB/s, NCCL bus bandwidth over NVLink 4 at ~350 GB/s). Without --machine the
# throughput model is the paper's DGX-2 (throughput.Machine's defaults).
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
MACHINE_PRESETS = {
    "dgx2": [
        "--devices-per-node",
        "16",
        "--tp-devices-per-node",
        "16",
        "--device-memory-gb",
        "32",
        "--host-memory-gb",
        "1536",
    ],
    "hgx-h100": [*_HGX, "--device-memory-gb", "80", "--device-mem-gbs", "3350"],
    "hgx-h200": [*_HGX, "--device-memory-gb", "141", "--device-mem-gbs", "4800"],
}
