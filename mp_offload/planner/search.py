"""The largest GPT that fits, and the ZeRO-Offload paper's size claims redone from the plan.

Shape families (``--family``):
  gpt3    width and depth grow together, like the GPT-3 table: widths 768 ... 16384,
          head size 64 below 2048 and 128 from there, and for width h any depth
          h/128 <= L <= h/64 (so 1.3B = 24x2048, 6.7B = 32x4096, 13B = 40x5120 and
          70B-class = 80x8192 are all members). Consecutive widths' ranges overlap, so
          sizes are continuous to within one layer.
  layers  width, heads and everything else as given; only the depth grows.
For each width the depth is found by bisection (memory only grows with depth); the
answer is the member with the most parameters that fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial

import torch

from ..model.gpt import GPTConfig, num_parameters
from .fraction import pick_offload_fraction
from .memory import GiB, Hardware, JobPlan, Run, plan_job

GPT3_WIDTHS = (
    768,
    1024,
    1536,
    2048,
    2560,
    3072,
    3584,
    4096,
    5120,
    6144,
    7168,
    8192,
    10240,
    12288,
    14336,
    16384,
)
FAMILIES = ("gpt3", "layers")


def family_widths(family: str, base: GPTConfig, tp: int) -> list[tuple[int, int, int, int]]:
    """(hidden, heads, min layers, max layers) for each width the family allows at ``tp``."""
    if family == "layers":
        return [(base.hidden_size, base.num_attention_heads, 1, 4096)]
    if family != "gpt3":
        raise ValueError(f"--family must be one of {FAMILIES}, got {family!r}")
    out = []
    groups = base.num_query_groups if base.group_query_attention else None
    for h in GPT3_WIDTHS:
        heads = h // (64 if h < 2048 else 128)
        if groups is not None and heads % groups:  # GQA keeps the base's query groups
            continue
        if heads % tp == 0 and h % tp == 0:
            out.append((h, heads, -(-h // 128), h // 64))
    return out


def _shape(base: GPTConfig, h: int, heads: int, layers: int, family: str) -> GPTConfig:
    if family == "layers":
        return replace(base, num_layers=layers)
    return replace(
        base, num_layers=layers, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=4 * h
    )


@dataclass
class Found:
    cfg: GPTConfig | None  # None: not even the smallest member fits
    params: int
    plan: JobPlan | None
    limit: str  # what stops it from growing: device, host, or the family's range


def max_model(run: Run, hw: Hardware, family: str = "gpt3", pick_fraction: bool = False) -> Found:
    """``pick_fraction`` (offload): each candidate keeps on the device the share of its
    optimizer state that fits there (``--optimizer-offload-fraction``), which lets a
    host-bound model grow; the found plan's ``run.options.offload_fraction`` is that F."""

    def plan_at(h, heads, layers):
        candidate = replace(run, cfg=_shape(run.cfg, h, heads, layers, family))
        if pick_fraction and run.mode == "offload":
            return pick_offload_fraction(candidate, hw)[1]
        return plan_job(candidate, hw)

    best = Found(None, 0, None, "nothing fits")
    for h, heads, lo, hi in family_widths(family, run.cfg, run.tp):
        plan = partial(plan_at, h, heads)  # depth -> plan at this width
        if not plan(lo).fits:
            continue
        ok = lo  # bisection: ``ok`` fits, ``bad`` is the first depth known not to
        bad = hi + 1
        while bad - ok > 1:
            mid = (ok + bad) // 2
            ok, bad = (mid, bad) if plan(mid).fits else (ok, mid)
        p = plan(ok)
        n = num_parameters(p.run.cfg, run.tp)
        if n > best.params:
            if bad <= hi:
                nxt = plan(bad)
                limit = "device" if not nxt.fits_device else "host"
            else:
                limit = "family range"
            best = Found(p.run.cfg, n, p, limit)
    return best


# ------------------------------------------------------------------ paper claims
def _reported(gpu: str) -> float:
    """The device memory ``gpu`` really reports (named_models.GPU_MEMORY_MIB), GiB."""
    from .named_models import device_memory_gib

    return device_memory_gib(gpu)


# DGX-2 (1.5 TB host); its "32GB" V100s report 31.75 GiB
V100 = dict(device_memory_gb=_reported("V100-32GB"), devices_per_node=16, host_memory_gb=1536)


@dataclass
class Row:
    label: str
    hw: Hardware
    mode: str
    tp: int = 1
    dp: int = 1
    claim: str = ""  # what the paper says, or "" for this project's own rows
    claim_b: float | None = None  # the paper's number, billions
    # The optimizer options of the row, beside bf16 offload's defaults. micro_batches=2:
    # an fp32 gradient slice on the host, as the paper's ZeRO-Offload keeps (gradient
    # accumulation here); 1: Adam reads the gradients as they came down (no fp32 copy).
    # bf16 or 8-bit moments; store_param_remainders: the host master at 2 B.
    options: dict = field(default_factory=dict)
    pick_fraction: bool = False  # keep on the device the optimizer share that fits there


def _at_all(**kw) -> Hardware:
    """The paper's machines: what fits at all, as its claims were (no device reserve)."""
    return Hardware(device_memory_reserve_gb=0.0, **kw)


def _target(gpu: str, host_gb: int, devices: int, name: str) -> Hardware:
    """One of this project's targets, planned as a run would be (the device reserve kept
    free)."""
    return Hardware(
        device_memory_gb=_reported(gpu), host_memory_gb=host_gb, devices_per_node=devices, name=name
    )


def _paper_machines() -> dict[str, Hardware]:
    """The table's machines by the key its rows name them with."""
    # Host sizes assumed for the targets: a single-GPU slice of a DGX/HGX node gets 1/8 of
    # its 2 TiB (256 GiB); the lent device machine has 128 GiB.
    return {
        "v100": _at_all(**dict(V100, devices_per_node=1), name="1x V100-32GB, 1.5 TB host"),
        "dgx2": _at_all(**V100, name="DGX-2: 16x V100-32GB, 1.5 TB host"),
        "h100": _target("H100-80GB", 256, 1, "1x 80GB GPU, 256 GiB host"),
        "hgx": _target("H100-80GB", 2048, 8, "8x 80GB GPU node, 2 TiB host"),
        "h200": _target("H200-141GB", 256, 1, "1x H200-141GB, 256 GiB host"),
        "h200-lent": _target("H200-141GB", 128, 1, "1x H200 (139.8 GiB), 128 GiB host"),
        "h200x8": _target("H200-141GB", 2048, 8, "8x H200-141GB node, 2 TiB host"),
    }


_SMALL = dict(claim="~1.4B", claim_b=1.4)  # the paper: PyTorch alone on one V100
_K2 = dict(micro_batches=2)
_OFFLOAD = dict(claim="~13B", claim_b=13.0, options=_K2)  # ZeRO-Offload on one V100
_MP_ALONE = dict(claim="<15B", claim_b=15.0)  # model parallelism alone on a DGX-2
_MP_OFFLOAD = dict(claim="~70B", claim_b=70.0, options=_K2)  # + ZeRO-Offload
_M_BF16 = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
_M_8BIT = dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
_BF16_MOMENTS = dict(options=_M_BF16)
_FRACTION = dict(pick_fraction=True)
_REM = dict(options=dict(store_param_remainders=True))
_REM_BF16 = dict(options=dict(store_param_remainders=True, **_M_BF16))
_REM_8BIT = dict(options=dict(store_param_remainders=True, **_M_8BIT))
# (label, machine key, mode, the Row's other fields): the paper's rows, then this project's
# targets
_PAPER_ROWS = (
    ("PyTorch (mixed-precision Adam)", "v100", "pytorch", _SMALL),
    ("PyTorch as apex O2 ran it (20 B/param)", "v100", "pytorch-o2", _SMALL),
    ("ZeRO-Offload (fp32 grads on host)", "v100", "offload", _OFFLOAD),
    ("ZeRO-Offload, no fp32 grad copy", "v100", "offload", {}),
    ("+ bf16 moments", "v100", "offload", _BF16_MOMENTS),
    ("model parallelism alone, TP=16", "dgx2", "pytorch", dict(tp=16, **_MP_ALONE)),
    ("model parallelism alone, TP=8 x DP=2", "dgx2", "pytorch", dict(tp=8, dp=2, **_MP_ALONE)),
    ("TP=16, apex O2 (20 B/param)", "dgx2", "pytorch-o2", dict(tp=16, **_MP_ALONE)),
    ("TP=8 x DP=2 + ZeRO-Offload (fp32 grads)", "dgx2", "offload", dict(tp=8, dp=2, **_MP_OFFLOAD)),
    ("TP=16 + ZeRO-Offload (fp32 grads)", "dgx2", "offload", dict(tp=16, **_MP_OFFLOAD)),
    ("TP=8 x DP=2 + Offload, no fp32 grad copy", "dgx2", "offload", dict(tp=8, dp=2)),
    ("TP=16 + Offload, no fp32 grads, bf16 m/v", "dgx2", "offload", dict(tp=16, **_BF16_MOMENTS)),
    ("TP=16 + Offload + remainders", "dgx2", "offload", dict(tp=16, **_REM)),
    ("TP=16 + Offload + remainders, bf16 m/v", "dgx2", "offload", dict(tp=16, **_REM_BF16)),
    ("TP=16 + Offload + remainders, 8-bit m/v", "dgx2", "offload", dict(tp=16, **_REM_8BIT)),
    ("PyTorch (mixed-precision Adam)", "h100", "pytorch", {}),
    ("ZeRO-2, no offload (this code)", "h100", "zero2", {}),
    ("ZeRO-Offload (this code)", "h100", "offload", {}),
    ("+ offload fraction (device share)", "h100", "offload", _FRACTION),
    ("+ remainders (host master 2 B)", "h100", "offload", _REM),
    ("+ remainders, bf16 m/v", "h100", "offload", _REM_BF16),
    ("+ remainders, 8-bit m/v", "h100", "offload", _REM_8BIT),
    ("TP=8 + ZeRO-Offload", "hgx", "offload", dict(tp=8)),
    ("PyTorch (mixed-precision Adam)", "h200", "pytorch", {}),
    ("ZeRO-Offload (this code)", "h200", "offload", {}),
    ("+ offload fraction (device share)", "h200", "offload", _FRACTION),
    ("+ remainders (host master 2 B)", "h200", "offload", _REM),
    ("+ remainders, bf16 m/v", "h200", "offload", _REM_BF16),
    ("+ remainders, 8-bit m/v", "h200", "offload", _REM_8BIT),
    ("ZeRO-Offload (this code)", "h200-lent", "offload", {}),
    ("TP=8 + ZeRO-Offload", "h200x8", "offload", dict(tp=8)),
)


def paper_rows() -> list[Row]:
    machines = _paper_machines()
    return [Row(label, machines[key], mode, **more) for label, key, mode, more in _PAPER_ROWS]


def paper_base(seq: int = 1024, micro_batch: int = 1, vocab: int = 50257) -> GPTConfig:
    """The shape assumptions of every row: GPT-2 vocabulary, recomputation on."""
    return GPTConfig(
        num_layers=1,
        hidden_size=1024,
        num_attention_heads=16,
        seq_length=seq,
        vocab_size=vocab,
        recompute_activations=True,
    )


def paper_table(
    base: GPTConfig | None = None, micro_batch: int = 1, family: str = "gpt3"
) -> list[tuple[Row, Found]]:
    base = base or paper_base()
    return [
        (
            row,
            max_model(
                Run(
                    base, tp=row.tp, dp=row.dp, mode=row.mode, micro_batch=micro_batch
                ).with_options(**row.options),
                row.hw,
                family,
                pick_fraction=row.pick_fraction,
            ),
        )
        for row in paper_rows()
    ]


def format_paper_table(results: list[tuple[Row, Found]]) -> str:
    lines = [
        f"{'hardware':<42}{'mode':<43}{'largest':>9}  {'shape (LxH/heads)':<19}"
        f"{'limit':<14}{'paper':>6}"
    ]
    for row, found in results:
        shape = (
            f"{found.cfg.num_layers}x{found.cfg.hidden_size}/{found.cfg.num_attention_heads}"
            if found.cfg
            else "-"
        )
        label = row.label
        if row.pick_fraction and found.plan is not None:
            label += f" F={found.plan.run.options.offload_fraction:.2f}"
        lines.append(
            f"{row.hw.name:<42}{label:<43}{found.params / 1e9:8.2f}B  {shape:<19}"
            f"{found.limit:<14}{row.claim or '-':>6}"
        )
    return "\n".join(lines)


def bytes_per_param_note() -> str:
    return (
        f"host bytes per parameter with offload: 12 (fp32 master, m, v) + 2 (param "
        f"staging) + 2 (grad staging) = 16, and 4 more for an fp32 gradient sum with "
        f"gradient accumulation (20); a 1.5 TB host holds {1536 * GiB / 16 / 1e9:.0f}B "
        f"({1536 * GiB / 20 / 1e9:.0f}B) parameters before any process overhead; with "
        f"--store-param-remainders the master takes 2 (14), with bf16 m/v 2 + 2, with 8-bit "
        f"m/v about 1 + 1 (remainders + 8-bit: 8, {1536 * GiB / 8 / 1e9:.0f}B on 1.5 TB)"
    )
