"""The memory planner: will a run fit, where, and what to change so it does.

    from moetune.plan import make_plan
    plan = make_plan(spec, cfg, cards=["H100-80GB", "H200"], estimator="analytic")
    plan.peak_bytes, plan.components, plan.overhead_bytes, plan.required_bytes
    plan.fits["H200"].fits, plan.recommendations, plan.best["RTX-4090"], plan.to_json()

`estimator="trace"` counts the live bytes of the real training step on fake tensors
(`plan.trace`, cached on disk); "analytic" (`plan.analytic`) is instant and calibrated
against it. Overhead beyond live tensors (`plan.overhead`) is a separate line.
"""

from __future__ import annotations

from moetune.plan import (
    host,  # noqa: F401 – registers the "cpu" card (this host)
    serve,  # noqa: F401 – registers vLLM in plan.serve.engines' registry
)
from moetune.plan.analytic import AnalyticEstimate, estimate, estimate_step
from moetune.plan.fit import CardFit, MemoryPlan, Recommendation, analytic, card_fit
from moetune.plan.hardware import Card, all_cards, card_ids, get_card
from moetune.plan.overhead import Overhead, overhead_for
from moetune.plan.planner import make_plan
from moetune.plan.step import Step

__all__ = [
    "AnalyticEstimate",
    "Card",
    "CardFit",
    "MemoryPlan",
    "Overhead",
    "Recommendation",
    "Step",
    "all_cards",
    "analytic",
    "card_fit",
    "card_ids",
    "estimate",
    "estimate_step",
    "get_card",
    "make_plan",
    "overhead_for",
]
