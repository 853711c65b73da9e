"""Memory planner, model-size search, paper table and throughput model (see plan.py)."""

from .activations import ActivationEstimate, estimate_activations
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
