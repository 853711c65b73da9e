"""How much larger a model fits with offload's smaller host-state forms (docs/DESIGN.md §4).

With offload the host usually limits the model: per parameter it holds the fp32 master
(4 B), the moments (4 + 4), the staging (2 + 2) and, with k > 1 micro-batches summed on
the host, an fp32 gradient (4). ``--store-param-remainders`` keeps the master as the
bf16 staging plus a 2-byte remainder (-2 B), bf16 moments take 2 + 2 (-4 B) and 8-bit
ones about 1 + 1 (-6 B). ``host_form_gains`` plans the largest model of each form on the
same hardware, from the optimizer's own placement like every plan.
"""

from __future__ import annotations

import torch

from .memory import Hardware, Run
from .search import Found, max_model

_BF16 = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
_8BIT = dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
_REM = dict(store_param_remainders=True)
# (label, the optimizer options of the form): what `python -m mp_offload.plan` compares
HOST_FORMS = (
    ("--store-param-remainders", _REM),
    ("bf16 moments", _BF16),
    ("8-bit moments", _8BIT),
    ("remainders + bf16 moments", dict(**_REM, **_BF16)),
    ("remainders + 8-bit moments", dict(**_REM, **_8BIT)),
)


def host_form_gains(
    run: Run, hw: Hardware, family: str, pick_fraction: bool
) -> tuple[Found, list[tuple[str, Found]]]:
    """(the largest model with an fp32 master and fp32 moments, [(form, its largest)]) for
    offload ``run`` (bf16: remainders need it; fp32 params get the moment forms only)."""
    f32 = torch.float32
    base = run.with_options(store_param_remainders=False, exp_avg_dtype=f32, exp_avg_sq_dtype=f32)
    plain = max_model(base, hw, family, pick_fraction=pick_fraction)
    bf16 = run.options.dtype == torch.bfloat16
    forms = [(label, kw) for label, kw in HOST_FORMS if bf16 or "store_param_remainders" not in kw]
    return plain, [
        (label, max_model(base.with_options(**kw), hw, family, pick_fraction=pick_fraction))
        for label, kw in forms
    ]


def format_host_form_gains(plain: Found, gains: list[tuple[str, Found]]) -> str:
    """One short paragraph: each form's largest model against the plain one."""
    if plain.cfg is None:
        return "host-state forms: nothing fits even with the smaller host state"
    parts = [
        f"{label} {f.params / 1e9:.2f}B ({f.params / plain.params - 1:+.0%}, {f.limit})"
        for label, f in gains
        if f.cfg is not None
    ]
    return (
        f"smaller host state (offload, same hardware and batch): with an fp32 master and fp32 "
        f"moments the largest GPT is {plain.params / 1e9:.2f}B ({plain.limit}-bound); "
        + "; ".join(parts)
        + " (largest model, change, what stops it; 8-bit moments keep all of the state on"
        " the host, no device share)"
    )
