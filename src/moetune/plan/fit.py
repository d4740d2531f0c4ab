"""The plan: peak memory by component, overhead stated apart, fit per card, and the
cheapest changes that make a run fit a card it does not fit.

Recommendations search combinations of moves (`MOVES`), each with a quality cost, in
order of total cost, re-planning every candidate with the analytic estimator (ms each).
Experts are never dropped: an MoE fine-tune that leaves its experts untrained is not the
same run, so when nothing else fits the plan says so instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from moetune.config import RunConfig
from moetune.errors import ConfigError, MoetuneError
from moetune.model.spec import ModelSpec
from moetune.plan.analytic import AnalyticEstimate, Step, estimate_step, frozen_bytes
from moetune.plan.hardware import Card, all_cards, get_card
from moetune.plan.layout import AdapterLayout, adapter_layout
from moetune.plan.overhead import Overhead, card_overhead, overhead_for
from moetune.plan.profiles import profile_for

Estimator = Literal["trace", "analytic"]
GiB = 1024**3
MAX_CANDIDATES = 800  # analytic re-plans per plan (≈ 3–6 ms each)
RECS_PER_CARD = 3


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
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

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
    "analytic" is instant. Recommendations always use the analytic for speed.
    """
    chosen = [get_card(c) for c in cards] if cards else all_cards()
    if estimator not in ("trace", "analytic"):
        raise ConfigError(f"unknown estimator {estimator!r}", "use trace or analytic")
    peak, components, op, phase, trainable = _estimate(spec, cfg, estimator)
    fits = {c.id: card_fit(c, peak) for c in chosen}
    plan = MemoryPlan(
        model=spec.name,
        estimator=estimator,
        peak_bytes=peak,
        components=components,
        peak_op=op,
        peak_phase=phase,
        overhead=_plan_overhead(chosen, peak),
        trainable_params=trainable,
        total_params=spec.total_params,
        fits=fits,
        settings=_settings(cfg),
        notes=_notes(spec, cfg),
    )
    missing = [c for c in chosen if not fits[c.id].fits]
    plan.recommendations.extend(recommend(spec, cfg, missing))
    return plan


def _estimate(
    spec: ModelSpec, cfg: RunConfig, estimator: Estimator
) -> tuple[int, dict[str, int], str | None, str, int]:
    if estimator == "trace":
        from moetune.plan.tracecache import cached_trace

        t = cached_trace(spec, cfg)
        return t.peak_bytes, dict(t.at_peak), t.peak_op, t.peak_phase, t.trainable_params
    est = analytic(spec, cfg)
    return est.peak_bytes, est.components, None, est.peak_phase, est.trainable_params


def analytic(spec: ModelSpec, cfg: RunConfig) -> AnalyticEstimate:
    """The analytic estimate of `cfg` (LoRA layouts cached; target drops filter them)."""
    return estimate_step(spec, Step.from_config(cfg), _layout(spec, cfg))


def _layout(spec: ModelSpec, cfg: RunConfig) -> AdapterLayout | None:
    if cfg.train.method == "full":
        return None
    widest = cfg.lora.model_copy(update={"targets": list(_ALL_TARGETS)})
    kinds = set(cfg.lora.targets) | ({"router"} if cfg.lora.train_router else set())
    try:  # one build for every target subset the recommendations try
        base = adapter_layout(spec, widest)
    except MoetuneError:  # e.g. a dense model has no experts to target
        return adapter_layout(spec, cfg.lora)
    return base.only(kinds).at_rank(cfg.lora.rank)


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
        "method": cfg.train.method,
        "rank": cfg.lora.rank,
        "targets": list(cfg.lora.targets),
        "expert_mapping": cfg.lora.expert_mapping,
        "seq_len": cfg.train.seq_len,
        "batch_size": cfg.train.batch_size,
        "gradient_checkpointing": cfg.train.gradient_checkpointing,
        "dtype": cfg.model.dtype,
        "optimizer": "fused AdamW (HF Trainer / TRL default), steady state",
    }


def split_lora(spec: ModelSpec, cfg: RunConfig) -> bool:
    """Whether the step runs moetune's split-LoRA experts (engine moetune on expert targets)."""
    targeted = "experts" in cfg.lora.targets and spec.is_moe and cfg.train.method != "full"
    return targeted and cfg.lora.engine == "moetune"


def _notes(spec: ModelSpec, cfg: RunConfig) -> list[str]:
    notes = []
    if split_lora(spec, cfg):
        notes.append("engine moetune: split LoRA – no full-size expert W+ΔW or its gradient")
    if cfg.train.method == "qlora" or cfg.train.quantization != "none":
        notes.append(
            "bitsandbytes quantizes nn.Linear only: the fused experts stay bf16 and "
            "prepare_model_for_kbit_training upcasts them to fp32 – on an MoE this uses "
            "more memory than bf16 LoRA (analytic only)"
        )
    if cfg.lora.dropout and cfg.train.method != "full":
        notes.append(
            f"sized with lora.dropout=0: peft refuses dropout={cfg.lora.dropout} on "
            "ParamWrapper (expert) targets, and dropout adds one input-sized tensor per "
            "adapted Linear otherwise"
        )
    family = profile_for(spec.model_type).notes
    return [*notes, family] if family else notes


# ---------------------------------------------------------------- recommendations


@dataclass(frozen=True)
class Move:
    """One change to a config, with a quality cost and how to say it."""

    name: str
    cost: float
    apply: Callable[[RunConfig], RunConfig | None]  # None: does not apply
    says: Callable[[RunConfig, RunConfig], tuple[str, str]]  # (words, --set override)


def _lora(cfg: RunConfig, **update: Any) -> RunConfig:
    return cfg.model_copy(update={"lora": cfg.lora.model_copy(update=update)})


def _train(cfg: RunConfig, **update: Any) -> RunConfig:
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=update)})


def _drop(kind: str) -> Callable[[RunConfig], RunConfig | None]:
    def apply(cfg: RunConfig) -> RunConfig | None:
        if kind not in cfg.lora.targets or cfg.train.method == "full":
            return None
        if len(cfg.lora.targets) == 1:  # nothing would be left to train
            return None
        return _lora(cfg, targets=[t for t in cfg.lora.targets if t != kind])

    return apply


def _targets_said(kind: str) -> Callable[[RunConfig, RunConfig], tuple[str, str]]:
    def says(_: RunConfig, new: RunConfig) -> tuple[str, str]:
        return f"drop LoRA on {kind}", f"lora.targets=[{','.join(new.lora.targets)}]"

    return says


MOVES: tuple[Move, ...] = (
    Move(
        "qlora→lora", 0.0,
        lambda c: _train(c, method="lora", quantization="none")
        if c.train.method == "qlora" or c.train.quantization != "none" else None,
        lambda o, n: ("bf16 LoRA instead of bitsandbytes (its fused experts end up fp32)",
                      "train.method=lora"),
    ),
    Move(
        "explicit", 0.05,
        lambda c: _lora(c, expert_mapping="explicit")
        if c.lora.expert_mapping == "automap" and c.train.method != "full" else None,
        lambda o, n: ("moetune's explicit expert targets (rank r on gate_up, not peft's 2r)",
                      "lora.expert_mapping=explicit"),
    ),
    Move(
        "gc", 0.1,
        lambda c: _train(c, gradient_checkpointing=True)
        if not c.train.gradient_checkpointing else None,
        lambda o, n: ("gradient checkpointing on (≈ 30 % slower, same result)",
                      "train.gradient_checkpointing=true"),
    ),
    Move(
        "batch", 0.2,
        lambda c: _train(c, batch_size=1) if c.train.batch_size > 1 else None,
        lambda o, n: (f"batch {o.train.batch_size} → 1 (keep the effective batch with gradient "
                      "accumulation)", "train.batch_size=1"),
    ),
    Move(
        "full→lora", 0.5,
        lambda c: _train(c, method="lora") if c.train.method == "full" else None,
        lambda o, n: ("LoRA instead of full fine-tuning", "train.method=lora"),
    ),
    Move("dense", 0.6, _drop("dense"), _targets_said("dense")),
    Move("shared", 0.8, _drop("shared"), _targets_said("shared")),
    Move("attention", 1.5, _drop("attention"), _targets_said("attention")),
)  # fmt: skip
RANK_STEP_COST = 1.0  # per halving of the rank (down to 4)
SEQ_STEP_COST = 1.5  # per halving of the sequence length (down to 256)
MIN_RANK, MIN_SEQ = 4, 256


@dataclass(frozen=True)
class _Candidate:
    cfg: RunConfig
    cost: float
    changes: tuple[str, ...]
    overrides: tuple[str, ...]
    moves: frozenset[str]


def _candidates(cfg: RunConfig, spec: ModelSpec) -> list[_Candidate]:
    """Every combination of moves, rank halvings and sequence halvings, cheapest first."""
    out = []
    for subset in _move_subsets(cfg, spec):
        for r_steps, s_steps in itertools.product(
            _halvings(cfg.lora.rank, MIN_RANK), _halvings(cfg.train.seq_len, MIN_SEQ)
        ):
            cand = _combine(cfg, subset, r_steps, s_steps)
            if cand is not None and cand.moves:
                out.append(cand)
    return sorted(out, key=lambda c: (c.cost, len(c.moves)))


def _move_subsets(cfg: RunConfig, spec: ModelSpec) -> Iterator[tuple[Move, ...]]:
    absent = {k for k, has in _parts(spec).items() if not has}
    usable = [m for m in MOVES if m.name not in absent and m.apply(cfg) is not None]
    for n in range(len(usable) + 1):
        yield from itertools.combinations(usable, n)


def _parts(spec: ModelSpec) -> dict[str, bool]:
    """Which droppable target kinds the model has at all."""
    return {
        "dense": bool(spec.dense_layers and spec.dense_intermediate_size),
        "shared": bool(spec.moe_layers and spec.shared_intermediate_size),
        "attention": True,
    }


def _halvings(value: int, floor: int) -> range:
    steps = 0
    while value // 2 ** (steps + 1) >= floor:
        steps += 1
    return range(steps + 1)


def _combine(
    cfg: RunConfig, subset: tuple[Move, ...], r_steps: int, s_steps: int
) -> _Candidate | None:
    new, changes, overrides, cost = cfg, [], [], 0.0
    for move in subset:
        applied = move.apply(new)
        if applied is None:
            return None
        words, override = move.says(new, applied)
        new, cost = applied, cost + move.cost
        changes.append(words)
        overrides.append(override)
    if r_steps and new.train.method != "full":
        rank = cfg.lora.rank // 2**r_steps
        changes.append(f"rank {cfg.lora.rank} → {rank}")
        overrides.append(f"lora.rank={rank}")
        new, cost = _lora(new, rank=rank), cost + r_steps * RANK_STEP_COST
    if s_steps:
        seq = cfg.train.seq_len // 2**s_steps
        changes.append(f"sequence length {cfg.train.seq_len} → {seq}")
        overrides.append(f"train.seq_len={seq}")
        new, cost = _train(new, seq_len=seq), cost + s_steps * SEQ_STEP_COST
    # halving twice includes halving once, so a fitting halving dominates deeper ones
    steps = {f"rank{i}" for i in range(1, r_steps + 1)} | {f"seq{i}" for i in range(1, s_steps + 1)}
    moves = frozenset({m.name for m in subset} | steps)
    return _Candidate(new, cost, tuple(changes), tuple(overrides), moves)


def recommend(spec: ModelSpec, cfg: RunConfig, cards: list[Card]) -> list[Recommendation]:
    """Up to RECS_PER_CARD cheapest fitting changes for each card in `cards`."""
    if not cards:
        return []
    candidates = _candidates(cfg, spec)
    floor = _weights_floor(spec, cfg)
    hopeless = [c for c in cards if not card_fit(c, floor).fits]
    cards = [c for c in cards if c not in hopeless]
    found: dict[str, list[Recommendation]] = {c.id: [] for c in cards}
    seen: dict[str, list[frozenset[str]]] = {c.id: [] for c in cards}
    for cand in candidates[:MAX_CANDIDATES]:
        open_cards = [c for c in cards if len(found[c.id]) < RECS_PER_CARD]
        if not open_cards:
            break
        peak = analytic(spec, cand.cfg).peak_bytes
        for card in open_cards:
            _consider(card, cand, peak, found[card.id], seen[card.id])
    out = [r for c in cards for r in found[c.id]]
    stuck = hopeless + [c for c in cards if not found[c.id]]
    out += [_no_fit(spec, cfg, c, candidates) for c in stuck]
    return sorted(out, key=lambda r: (not r.fits, r.cost, r.card))


def _weights_floor(spec: ModelSpec, cfg: RunConfig) -> int:
    """Live bytes no searched change goes below: the frozen weights (bf16 or as quantized)."""
    step = Step.from_config(cfg)
    return int(min(spec.total_params * step.weight_bytes, frozen_bytes(spec, step)))


def _consider(
    card: Card,
    cand: _Candidate,
    peak: int,
    found: list[Recommendation],
    seen: list[frozenset[str]],
) -> None:
    fit = card_fit(card, peak)
    if not fit.fits or any(prev <= cand.moves for prev in seen):
        return  # a cheaper subset of these moves already fits
    seen.append(cand.moves)
    notes = ("experts kept (never dropped)",) if "attention" in cand.moves else ()
    rec = Recommendation(
        card.id, cand.changes, cand.overrides, round(cand.cost, 2), peak,
        fit.required_bytes, fit.headroom_bytes, notes,
    )  # fmt: skip
    found.append(rec)


def _no_fit(spec: ModelSpec, cfg: RunConfig, card: Card, cands: list[_Candidate]) -> Recommendation:
    """No searched change fits: say how far the leanest one is, and what is left."""
    leanest = cands[-1] if cands else _Candidate(cfg, 0.0, (), (), frozenset())
    peak = analytic(spec, leanest.cfg).peak_bytes
    fit = card_fit(card, peak)
    frozen = spec.total_params * 2
    why = (
        f"the bf16 frozen weights alone ({frozen / GiB:.0f} GiB) exceed the card"
        if frozen > card.usable_bytes
        else "even the leanest searched config is short"
    )
    return Recommendation(
        card.id, leanest.changes, leanest.overrides, round(leanest.cost, 2), peak,
        fit.required_bytes, fit.headroom_bytes,
        (f"{why}; experts were not dropped (that would not train the MoE) – "
         "use a larger card, several GPUs, or quantized/offloaded frozen experts",),
        fits=False,
    )  # fmt: skip
