"""`make_plan`: peak memory by component, overhead stated apart, fit per card, the
cheapest changes that make a run fit a card it does not fit (`plan.recommend`), and the
best-quality config per card (`MemoryPlan.best`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import moetune.plan.trace.cache as tracecache
from moetune.config import RunConfig
from moetune.errors import ConfigError, TraceError
from moetune.model.spec import ModelSpec
from moetune.plan.fit import Estimator, MemoryPlan, Recommendation, analytic, card_fit
from moetune.plan.hardware import Card, all_cards, get_card
from moetune.plan.host import as_run_on
from moetune.plan.methods import as_trained, method_notes, method_terms, with_rollout
from moetune.plan.overhead import Overhead, overhead_for
from moetune.plan.profiles.registry import mixer_notes, profile_for, uncalibrated
from moetune.plan.recommend import recommend, refuses_checkpointing
from moetune.plan.step import split_lora
from moetune.plan.stored import refuse_unreadable, stored_summary
from moetune.plan.trace.duration import expected_trace_s

Warn = Callable[[str], None]


def to_stderr(text: str) -> None:
    """The default warning sink: one line on stderr (stdout may be --json)."""
    print(f"warning: {text}", file=sys.stderr, flush=True)


def make_plan(
    spec: ModelSpec,
    cfg: RunConfig,
    cards: list[str] | None = None,
    estimator: Estimator = "analytic",
    warn: Warn = to_stderr,
) -> MemoryPlan:
    """Plan `cfg` on `spec` for `cards` (default: the whole catalog).

    `estimator="trace"` runs the fake-tensor trace of the real step (cached on disk);
    "analytic" is instant, and traces instead when a layer's mixer kind has no calibrated
    term (the plan's notes say so). Recommendations always use the analytic for speed.
    Such a fallback is never silent: `warn` gets one line with the trace's expected time
    before it starts, and the plan's `fallback` holds the same.
    """
    refuse_unreadable(spec)  # lint and train plan first: the same refusal for all three
    chosen = [get_card(c) for c in cards] if cards else all_cards()
    if estimator not in ("trace", "analytic"):
        raise ConfigError(f"unknown estimator {estimator!r}", "use trace or analytic")
    if chosen and all(c.is_host for c in chosen):  # this host alone: as train runs there
        cfg = as_run_on(cfg, chosen[0])
    cfg, gc_off = as_checkpointable(cfg, spec)
    slow = fallback_warning(spec, cfg, estimator)
    if slow is not None:
        warn(slow["warning"])
    used, fallback, (peak, components, op, phase, trainable) = _estimate_as(spec, cfg, estimator)
    fits = {c.id: card_fit(c, peak) for c in chosen}
    stored = stored_summary(spec, cfg)
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
        notes=[
            *([stored["text"]] if stored else []),
            *fallback,
            *gc_off,
            *_notes(spec, cfg),
            *card_notes(chosen),
        ],
        requested=estimator if used != estimator else None,
        fallback=slow,
        stored=stored,
    )
    missing = [c for c in chosen if not fits[c.id].fits]
    plan.recommendations.extend(recommend(spec, cfg, missing))
    plan.best.update({c.id: _best(plan, c.id) for c in chosen})
    return plan


def card_notes(cards: list[Card]) -> list[str]:
    """What the plan assumes of its cards: fp16 where one has no bf16, and what a card given
    by its memory is taken to be."""
    fp16 = [c.id for c in cards if c.is_cuda and not c.bf16]
    notes = [c.assumed for c in cards if c.assumed]
    if fp16:
        notes.append(
            f"{', '.join(fp16)}: no bfloat16 on the card, so the run computes in fp16 (the same "
            "2 bytes a value; train.precision auto picks fp16 there, with loss scaling)"
        )
    return notes


def as_checkpointable(cfg: RunConfig, spec: ModelSpec) -> tuple[RunConfig, list[str]]:
    """`cfg` as it can really train: checkpointing off where the model's class refuses it
    (train turns it off too), with the note that says so; else `cfg` unchanged."""
    refused = refuses_checkpointing(spec) if cfg.train.gradient_checkpointing else None
    if refused is None:
        return cfg, []
    off = cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"gradient_checkpointing": False})}
    )
    return off, [
        f"gradient checkpointing is off: transformers' {refused} refuses it "
        "(supports_gradient_checkpointing = False), so moetune trains and plans it without: "
        "every layer's activations stay live"
    ]


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


def fallback_warning(
    spec: ModelSpec, cfg: RunConfig, estimator: Estimator
) -> dict[str, Any] | None:
    """What the analytic falling back to the trace will cost, said before it starts
    (None when the estimator asked for is the one that runs)."""
    used, _ = _choose(spec, cfg, estimator)
    if used == estimator:
        return None
    step = as_trained(cfg, spec)
    cached = tracecache.is_cached(spec, step)
    seconds = 0.0 if cached else expected_trace_s(spec, step)
    when = "cached: instant" if cached else f"expected ~{_duration(seconds)} on this machine"
    text = (
        f"analytic has {_missing(spec)}: tracing the real step instead ({when}; "
        f"{spec.model_type}, seq {step.train.seq_len})"
    )
    kinds = uncalibrated(spec)
    return {"warning": text, "kinds": kinds, "expected_s": round(seconds, 1), "cached": cached}


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


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
        # the step train.method really trains; looked up on use (tests stand in for it)
        t = tracecache.cached_trace(spec, as_trained(cfg, spec))
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


def _plan_overhead(cards: list[Card], peak: int) -> Overhead:
    """The plan's overhead line: CUDA's terms unless every chosen card is Apple (MPS), or
    every one is this host (CPU: the process beside the tensors)."""
    kinds = {c.kind for c in cards}
    kind = kinds.pop() if len(kinds) == 1 and kinds <= {"mps", "cpu"} else "cuda"
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
        "quantized_base": cfg.model.quantized_base,
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
