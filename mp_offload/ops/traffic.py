"""Host memory bytes per element that each pass of the optimizer step moves: one account.

The kernels' arrays as (name, bytes per element, mode). The benchmarks' traffic classes
(bench/bench_host_ceiling.py) and the planner's throughput model
(planner/throughput.py) both read these, and a test holds them to the dtypes of a real
ZeroOptimizer's buffers, so the model charges what the code moves.
"""

from __future__ import annotations

READ, WRITE, READ_WRITE = 1, 2, 3


def adam_arrays(
    grad: int = 4, exp_avg: int = 4, exp_avg_sq: int = 4, param_out: int = 0, remainders=False
):
    """The Adam pass (C++ ``adam_step``, torch's fused AdamW): the fp32 master and the
    moments read and written, the gradient read, the rounded params (``param_out``
    bytes, 0 for none) written. Arguments: bytes per element of each. With ``remainders``
    (``adam_step_remainder``) the master is the bf16 param that goes up and a 16-bit
    remainder, both read and written, and there is no separate param_out."""
    master = [("param_hi", 2, READ_WRITE), ("param_lo", 2, READ_WRITE)]
    arrays = [
        *(master if remainders else [("param", 4, READ_WRITE)]),
        ("grad", grad, READ),
        ("exp_avg", exp_avg, READ_WRITE),
        ("exp_avg_sq", exp_avg_sq, READ_WRITE),
    ]
    return arrays + ([("param_out", param_out, WRITE)] if param_out and not remainders else [])


def accumulate_arrays(src: int, first: bool):
    """One micro-batch's staged gradient (``src`` bytes) into the fp32 sum
    (``host_ops.accumulate_``): the first overwrites, the others add (and the last one's
    pass sums the squares for the norm: no extra bytes)."""
    return [("src", src, READ), ("dst", 4, WRITE if first else READ_WRITE)]


def publish_arrays(param: int):
    """The device share's publish: its fp32 master read, the rounded params written."""
    return [("master", 4, READ), ("params", param, WRITE)]


def bytes_per_element(arrays) -> int:
    return sum(nbytes * (2 if mode == READ_WRITE else 1) for _, nbytes, mode in arrays)
