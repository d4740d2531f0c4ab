"""The plan: peak memory by component, overhead stated apart, fit per card, the
cheapest changes that make a run fit a card it does not fit, and the best-quality
config per card (`MemoryPlan.best`).

The recommendation search (moves, quality costs, bounds) lives in `plan.recommend`;
it re-plans every candidate with `analytic` below.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from moetune.config import RunConfig
from moetune.errors import ConfigError, MoetuneError, TraceError
from moetune.model.spec import ModelSpec
from moetune.plan.analytic import AnalyticEstimate, Step, estimate_step, split_lora
from moetune.plan.hardware import Card, all_cards, get_card
from moetune.plan.layout import AdapterLayout, adapter_layout
from moetune.plan.methods import as_trained, method_notes, method_terms, with_rollout
from moetune.plan.overhead import Overhead, card_overhead, overhead_for
from moetune.plan.profiles import mixer_notes, profile_for, uncalibrated

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

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
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

    @property
    def overhead_bytes(self) -> int:
        return self.overhead.total

    @property
    def required_bytes(self) -> int:
        return self.peak_bytes + self.overhead_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "estimator": self.estimator,
            "estimator_requested": self.requested or self.estimator,
            "settings": dict(self.settings),
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
        }


# ---------------------------------------------------------------- the plan


def make_plan(
    spec: ModelSpec,
    cfg: RunConfig,
    cards: list[str] | None = None,
    estimator: Estimator = "analytic",
) -> MemoryPlan:
    """Plan `cfg` on `spec` for `cards` (default: the whole catalog).

    `estimator="trace"` runs the fake-tensor trace of the real step (cached on disk);
    "analytic" is instant, and traces instead when a layer's mixer kind has no calibrated
    term (the plan's notes say so). Recommendations always use the analytic for speed.
    """
    chosen = [get_card(c) for c in cards] if cards else all_cards()
    if estimator not in ("trace", "analytic"):
        raise ConfigError(f"unknown estimator {estimator!r}", "use trace or analytic")
    used, fallback, (peak, components, op, phase, trainable) = _estimate_as(spec, cfg, estimator)
    fits = {c.id: card_fit(c, peak) for c in chosen}
    plan = MemoryPlan(
        model=spec.name,
        estimator=used,
        peak_bytes=peak,
        components=components,
        peak_op=op,
        peak_phase=phase,
        overhead=_plan_overhead(chosen, peak),
        trainable_params=trainable,
        total_params=spec.total_params,
        fits=fits,
        settings=_settings(cfg),
        notes=[*fallback, *_notes(spec, cfg)],
        requested=estimator if used != estimator else None,
    )
    from moetune.plan.recommend import recommend  # the search re-plans with `analytic`

    missing = [c for c in chosen if not fits[c.id].fits]
    plan.recommendations.extend(recommend(spec, cfg, missing))
    plan.best.update({c.id: _best(plan, c.id) for c in chosen})
    return plan


def _estimate_as(
    spec: ModelSpec, cfg: RunConfig, estimator: Estimator
) -> tuple[Estimator, list[str], tuple[int, dict[str, int], str | None, str, int]]:
    """The estimate, by `estimator` or the trace it falls back to (then with a note why);
    a fallback trace that fails leaves the analytic, saying what it leaves out."""
    used, notes = _choose(spec, cfg, estimator)
    try:
        return used, notes, _estimate(spec, cfg, used)
    except TraceError as exc:
        if used == estimator:
            raise
        note = f"analytic: {_missing(spec)}, and the trace failed ({exc.cause}): their "
        return estimator, [note + "activations are left out"], _estimate(spec, cfg, estimator)


def _choose(spec: ModelSpec, cfg: RunConfig, estimator: Estimator) -> tuple[Estimator, list[str]]:
    """The estimator that runs, and a note when it is not the one asked for."""
    if estimator == "trace" or not uncalibrated(spec):
        return estimator, []
    if cfg.train.tuning == "qlora" or cfg.train.quantization != "none":  # fake tensors can't
        return estimator, [
            f"analytic: {_missing(spec)}, and a quantized step cannot be traced: their "
            "activations are left out"
        ]
    return "trace", [
        f"analytic has {_missing(spec)}: planned with the trace (the real step on fake "
        "tensors) instead; recommendations are analytic and leave those layers' activations out"
    ]


def _missing(spec: ModelSpec) -> str:
    kinds = ", ".join(uncalibrated(spec))
    return f"no calibrated activation term for {spec.model_type}'s {kinds} layers"


def _best(plan: MemoryPlan, card: str) -> Recommendation:
    """The config as it is when it fits the card, else the cheapest change that does
    (recommendations come fitting first, cheapest first), else why nothing searched fits."""
    fit = plan.fits[card]
    if fit.fits:
        return Recommendation(
            card, (), (), 0.0, plan.peak_bytes, fit.required_bytes, fit.headroom_bytes,
            ("fits as configured",),
        )  # fmt: skip
    return next(r for r in plan.recommendations if r.card == card)


def _estimate(
    spec: ModelSpec, cfg: RunConfig, estimator: Estimator
) -> tuple[int, dict[str, int], str | None, str, int]:
    if estimator == "trace":
        from moetune.plan.tracecache import cached_trace

        t = cached_trace(spec, as_trained(cfg, spec))  # the step train.method really trains
        peak, at_peak, phase = with_rollout(
            method_terms(cfg, spec), t.peak_bytes, dict(t.at_peak), t.peak_phase
        )
        return (
            peak,
            at_peak,
            t.peak_op if phase == t.peak_phase else None,
            phase,
            t.trainable_params,
        )
    est = analytic(spec, cfg)
    return est.peak_bytes, est.components, None, est.peak_phase, est.trainable_params


def analytic(spec: ModelSpec, cfg: RunConfig) -> AnalyticEstimate:
    """The analytic estimate of `cfg` (LoRA layouts cached; target drops filter them), for
    the step train.method trains and, where it samples, its rollout (plan/methods.py)."""
    est = estimate_step(spec, Step.from_config(as_trained(cfg, spec), spec), _layout(spec, cfg))
    peak, components, phase = with_rollout(
        method_terms(cfg, spec), est.peak_bytes, est.components, est.peak_phase
    )
    if phase == est.peak_phase:
        return est
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
    )


def _plan_overhead(cards: list[Card], peak: int) -> Overhead:
    """The plan's overhead line: CUDA's terms unless every chosen card is Apple (MPS)."""
    kind = "mps" if cards and all(c.kind == "mps" for c in cards) else "cuda"
    return overhead_for(kind, peak)


def _settings(cfg: RunConfig) -> dict[str, Any]:
    return {
        "tuning": cfg.train.tuning,
        "method": cfg.train.method,
        "rank": cfg.lora.rank,
        "expert_rank": cfg.lora.effective_expert_rank,
        "engine": cfg.lora.engine,  # as set; `notes` say when it resolves to moetune
        "targets": list(cfg.lora.targets),
        "expert_mapping": cfg.lora.expert_mapping,
        "seq_len": cfg.train.seq_len,
        "batch_size": cfg.train.batch_size,
        "gradient_checkpointing": cfg.train.gradient_checkpointing,
        "dtype": cfg.model.dtype,
        "experts_dtype": cfg.model.experts_dtype,
        "experts_double_quant": cfg.model.experts_double_quant,
        "optimizer": "fused AdamW (HF Trainer / TRL default), steady state",
    }


def _notes(spec: ModelSpec, cfg: RunConfig) -> list[str]:
    notes = method_notes(cfg, spec)
    if split_lora(spec, cfg):
        notes.append("engine moetune: split LoRA – no full-size expert W+ΔW or its gradient")
    if cfg.train.tuning == "qlora" or cfg.train.quantization != "none":
        notes.append(
            "bitsandbytes quantizes nn.Linear only: the fused experts stay bf16 and "
            "prepare_model_for_kbit_training upcasts them to fp32 – on an MoE this uses "
            "more memory than bf16 LoRA (analytic only)"
        )
    if cfg.lora.dropout and cfg.train.tuning != "full":
        notes.append(
            f"sized with lora.dropout=0: peft refuses dropout={cfg.lora.dropout} on "
            "ParamWrapper (expert) targets, and dropout adds one input-sized tensor per "
            "adapted Linear otherwise"
        )
    family = profile_for(spec.model_type).notes
    return [*notes, *([family] if family else []), *mixer_notes(spec)]
