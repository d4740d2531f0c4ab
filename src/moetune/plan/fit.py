"""The plan's types and the two functions everything re-plans with: `analytic` (the
instant estimate of a config) and `card_fit` (does a peak fit a card).

`MemoryPlan` is built by `plan.planner.make_plan`; the recommendation search
(`plan.recommend`) re-plans every candidate with `analytic` here – neither imports the
other's caller, so the planner sits on top of both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from moetune.config import RunConfig
from moetune.errors import MoetuneError
from moetune.model.spec import ModelSpec
from moetune.plan.analytic import AnalyticEstimate, estimate_step
from moetune.plan.hardware import Card
from moetune.plan.layout import AdapterLayout, adapter_layout
from moetune.plan.methods import as_trained, method_terms, with_rollout
from moetune.plan.overhead import Overhead, card_overhead
from moetune.plan.step import Step

Estimator = Literal["trace", "analytic"]
GiB = 1024**3


@dataclass(frozen=True)
class CardFit:
    """Whether the run fits one card: required (live peak + that card's overhead) ≤ usable."""

    card: str
    fits: bool
    usable_bytes: int
    headroom_bytes: int  # usable − required (negative: short by that much)
    required_bytes: int
    overhead_bytes: int
    compute_dtype: str = "bf16"  # fp16 on a card without bf16 (T4, V100): same bytes a value

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "compute_dtype": self.compute_dtype,
            "usable_bytes": self.usable_bytes,
            "headroom_bytes": self.headroom_bytes,
            "required_bytes": self.required_bytes,
            "overhead_bytes": self.overhead_bytes,
        }


@dataclass(frozen=True)
class Recommendation:
    """A set of config changes that makes the run fit `card`, as the analytic predicts it."""

    card: str
    changes: tuple[str, ...]  # what to change, in words
    overrides: tuple[str, ...]  # the same as `--set section.field=value`
    cost: float  # quality cost, lower first (see MOVES)
    peak_bytes: int
    required_bytes: int
    headroom_bytes: int
    notes: tuple[str, ...] = ()
    fits: bool = True  # False: nothing searched fits; the leanest option and why
    tokens_per_s: float | None = None  # estimated where the change costs speed (offload)

    def describe(self) -> str:
        changes = "; ".join(self.changes) if self.changes else "no change"
        if not self.fits:
            return f"{self.card}: no searched change fits" + "".join(f" – {n}" for n in self.notes)
        text = (
            f"{self.card}: {changes} ⇒ {self.peak_bytes / GiB:.1f} GiB live, "
            f"{self.required_bytes / GiB:.1f} GiB required "
            f"({self.headroom_bytes / GiB:.1f} GiB headroom)"
        )
        return text + "".join(f" – {n}" for n in self.notes)

    def to_json(self) -> dict[str, Any]:
        return {
            "card": self.card,
            "changes": list(self.changes),
            "overrides": list(self.overrides),
            "cost": self.cost,
            "peak_bytes": self.peak_bytes,
            "required_bytes": self.required_bytes,
            "headroom_bytes": self.headroom_bytes,
            "notes": list(self.notes),
            "fits": self.fits,
            "tokens_per_s": self.tokens_per_s,
            "text": self.describe(),
        }


@dataclass(frozen=True)
class MemoryPlan:
    """Everything `moetune plan` reports. `peak_bytes` is live tensors only; the overhead
    (CUDA context, workspaces, allocator) is `overhead`, stated separately."""

    model: str
    estimator: Estimator
    peak_bytes: int
    components: dict[str, int]
    peak_op: str | None  # the aten op at the peak (trace only)
    peak_phase: str
    overhead: Overhead
    trainable_params: int
    total_params: int
    fits: dict[str, CardFit]
    recommendations: list[Recommendation] = field(default_factory=list)
    # per card: the config as is when it fits, else the cheapest fitting change, else why not
    best: dict[str, Recommendation] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    requested: Estimator | None = None  # the estimator asked for, when another one ran
    # the analytic's fallback to the trace, as warned before it ran (planner.fallback_warning)
    fallback: dict[str, Any] | None = None
    stored: dict[str, Any] | None = None  # a published quantised base (plan.stored)

    @property
    def overhead_bytes(self) -> int:
        return self.overhead.total

    @property
    def required_bytes(self) -> int:
        return self.peak_bytes + self.overhead_bytes

    @property
    def assumed(self) -> str:
        """The run the figures are for, in one line: what a user did not say is assumed."""
        s = self.settings
        rank = f"rank {s['rank']}" + (
            f" (experts {s['expert_rank']})" if s["expert_rank"] != s["rank"] else ""
        )
        gc = "on" if s["gradient_checkpointing"] else "off"
        return (
            f"{rank} · seq {s['seq_len']} · batch {s['batch_size']} · gradient checkpointing "
            f"{gc} · targets {','.join(s['targets'])} · {s['tuning']} {s['method']}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "estimator": self.estimator,
            "estimator_requested": self.requested or self.estimator,
            "settings": dict(self.settings),
            "assumed": self.assumed,
            "peak_bytes": self.peak_bytes,
            "components": dict(self.components),
            "peak_op": self.peak_op,
            "peak_phase": self.peak_phase,
            "trainable_params": self.trainable_params,
            "total_params": self.total_params,
            "overhead_bytes": self.overhead_bytes,
            "overhead": self.overhead.to_json(),
            "required_bytes": self.required_bytes,
            "fits": {card: fit.fits for card, fit in self.fits.items()},
            "cards": {card: fit.to_json() for card, fit in self.fits.items()},
            "recommendations": [r.to_json() for r in self.recommendations],
            "best": {card: r.to_json() for card, r in self.best.items()},
            "notes": list(self.notes),
            "fallback": self.fallback,
            "stored_experts": self.stored,
        }


def analytic(spec: ModelSpec, cfg: RunConfig) -> AnalyticEstimate:
    """The analytic estimate of `cfg` (LoRA layouts cached; target drops filter them), for
    the step train.method trains and, where it samples, its rollout (plan/methods.py)."""
    est = estimate_step(spec, Step.from_config(as_trained(cfg, spec), spec), _layout(spec, cfg))
    peak, components, phase = with_rollout(
        method_terms(cfg, spec), est.peak_bytes, est.components, est.peak_phase
    )
    if (peak, phase) == (est.peak_bytes, est.peak_phase):
        return est
    if phase == est.peak_phase:  # the trained step plus the replayed routing indices
        phases = {**est.phases, phase: peak}
        return replace(est, components=components, peak_bytes=peak, phases=phases)
    phases = {**est.phases, "rollout": peak}
    return replace(est, components=components, peak_bytes=peak, peak_phase=phase, phases=phases)


def _layout(spec: ModelSpec, cfg: RunConfig) -> AdapterLayout | None:
    if cfg.train.tuning == "full":
        return None
    lora = cfg.lora
    kinds = frozenset(lora.targets) | ({"router"} if lora.train_router else frozenset())
    ranks = (lora.rank, lora.effective_expert_rank)
    key = (id(spec), kinds, lora.expert_mapping, lora.train_router, *ranks)
    hit = _SHAPED.get(key)
    if hit is not None and hit[0] is spec:  # the search re-plans the same shapes many times
        return hit[1]
    widest = lora.model_copy(update={"targets": list(_ALL_TARGETS)})
    try:  # one build for every target subset and rank the recommendations try
        layout = adapter_layout(spec, widest).only(set(kinds))
    except MoetuneError:  # e.g. a dense model has no experts to target (or a bad config:
        layout = adapter_layout(spec, lora)  # then this raises the same error)
    _SHAPED[key] = (spec, layout)
    return layout


_SHAPED: dict[tuple[Any, ...], tuple[ModelSpec, AdapterLayout]] = {}
_ALL_TARGETS = ("attention", "experts", "dense", "shared")


def card_fit(card: Card, peak: int) -> CardFit:
    overhead = card_overhead(card, peak).total
    required = peak + overhead
    return CardFit(
        card=card.id,
        fits=required <= card.usable_bytes,
        usable_bytes=card.usable_bytes,
        headroom_bytes=card.usable_bytes - required,
        required_bytes=required,
        overhead_bytes=overhead,
        compute_dtype=card.compute_dtype,
    )
