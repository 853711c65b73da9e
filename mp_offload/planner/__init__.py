"""Memory planner, layout choice, model-size search, paper table and throughput model.

``python -m mp_offload.plan`` (or ``python -m mp_offload.planner``) is its command line,
``pretrain_gpt.py --dry-run`` its answer for a training command line. The pieces:
shapes (the exact per-rank parameter layout), activations (the estimate and its formula),
memory (``Run``: a model, its layout and the optimizer's own options; categories, modes,
fit), fraction (the offload fraction that fits), parallel_layout (TP, DP and F; the memory
savers when nothing fits), search (largest model, paper table), host_forms, throughput
and overlap_schedule (the step-time model), answer and report (what is printed),
named_models (``--model`` / ``--machine`` presets), arguments (the flags), cli (the command
line), dry_run (``--dry-run``, and ``rank_bytes`` for a memory preflight).
"""

from .activations import ActivationEstimate, estimate_activations
from .dry_run import dry_run, rank_bytes
from .memory import (
    ALL_MODES,
    EXACT,
    MODES,
    GiB,
    Hardware,
    JobPlan,
    RankPlan,
    Run,
    compare_modes,
    plan_job,
    plan_rank,
)
from .search import max_model, paper_rows, paper_table
from .shapes import (
    RankShapes,
    check_spec,
    meta_named_params,
    rank_shapes,
    spec_named_params,
)

__all__ = [
    "ActivationEstimate",
    "estimate_activations",
    "dry_run",
    "rank_bytes",
    "ALL_MODES",
    "EXACT",
    "MODES",
    "GiB",
    "Hardware",
    "JobPlan",
    "RankPlan",
    "Run",
    "compare_modes",
    "plan_job",
    "plan_rank",
    "max_model",
    "paper_rows",
    "paper_table",
    "RankShapes",
    "check_spec",
    "meta_named_params",
    "rank_shapes",
    "spec_named_params",
]
