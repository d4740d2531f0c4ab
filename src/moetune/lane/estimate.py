"""Time and money a run will take on a card, before anything is rented.

Training FLOPs per token of a LoRA step on a frozen base: forward 2·N_active, backward
through the activations 2·N_active (no full weight gradients), plus another forward
2·N_active when gradient checkpointing recomputes it – N_active being the parameters a
token really passes (top-k experts, not all). Divided by the card's dense bf16 peak at a
stated efficiency. A measured tokens/s from an earlier run on the same card (ledger)
replaces the guess when there is one: the newest ok train row with the same step signature
(`step_signature`, written by the trainer). Its tokens are the non-padding ones, so a rate
from padded batches is lower than the card's and the time it gives errs long, never short.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from moetune.config import RunConfig
from moetune.ledger import Ledger, select

# Fraction of the dense bf16 peak a stock transformers + peft MoE LoRA step reaches. Low on
# purpose: HF's per-expert path ran DeepSeek-V2-Lite LoRA at 303 tok/s (~0.5 % of an H100);
# grouped experts do better. An estimate that is too fast makes a watchdog that reaps the run.
MFU = 0.02
SETUP_S = 600  # pod start, image pull, pip install, staging: paid time before the first step


def _rows(path: str | None) -> int | None:
    """Rows of a local JSONL training file (other formats: unknown)."""
    if not path or not Path(path).is_file() or not path.endswith(".jsonl"):
        return None
    with Path(path).open("rb") as fh:
        return sum(1 for line in fh if line.strip())


def training_tokens(cfg: RunConfig) -> int | None:
    """Tokens the run processes at most: steps × batch × accumulation × sequence length."""
    t = cfg.train
    per_step = t.batch_size * t.grad_accum * t.seq_len
    if t.max_steps is not None:
        return t.max_steps * per_step
    rows = _rows(cfg.data.train_file)
    if rows is None:
        return None
    steps = math.ceil(rows / (t.batch_size * t.grad_accum)) * t.epochs
    return int(steps * per_step)


def step_signature(cfg: RunConfig, engine: str, devices: int) -> dict[str, Any]:
    """What decides a step's tokens/s besides the card. The trainer ledgers it with the rate;
    a launch reuses a rate only for the same signature. `engine` is lora.engine resolved,
    `devices` the GPUs one step runs on (a 4-GPU rate would size a 1-GPU run 4× too short)."""
    t, lora = cfg.train, cfg.lora
    return {
        "model": cfg.model.id,
        "engine": engine,
        "experts_dtype": cfg.model.experts_dtype,
        "precision": t.precision,
        "seq_len": t.seq_len,
        "batch_size": t.batch_size,
        "gradient_checkpointing": t.gradient_checkpointing,
        "lora_rank": lora.rank,
        "lora_expert_rank": lora.expert_rank or lora.rank,
        "lora_targets": sorted(lora.targets),
        "devices": devices,
    }


def launch_signature(spec: Any, cfg: RunConfig) -> dict[str, Any]:
    """The step signature of `cfg` as a launch will run it (one process on the pod's GPUs)."""
    from moetune.engine.resolve import resolve_engine

    engine = resolve_engine(spec, cfg.lora, cfg.model.experts_dtype)
    return step_signature(cfg, engine, cfg.lane.runpod.gpu_count)


@dataclass(frozen=True)
class Measured:
    """A training rate from the ledger: which row, how fast, on which card."""

    row_id: str
    tokens_per_s: float
    card: str


def measured_rate(ledger: Path | str, signature: dict[str, Any], card_id: str) -> Measured | None:
    """The newest ok train row with this step signature on this card, else None."""
    rows = [
        r
        for r in select(Ledger(ledger).read().rows, kind="train", status="ok")
        if r.metrics.get("card") == card_id
        and r.metrics.get("signature") == signature
        and (r.metrics.get("tokens_per_s") or 0) > 0
    ]
    newest = max(rows, key=lambda r: r.time, default=None)
    if newest is None:
        return None
    return Measured(newest.id, float(newest.metrics["tokens_per_s"]), card_id)


def flops_per_token(active_params: int, gradient_checkpointing: bool) -> float:
    return (6.0 if gradient_checkpointing else 4.0) * active_params


def estimate_train_s(spec: Any, cfg: RunConfig, bf16_tflops: float | None) -> float | None:
    """Seconds of training on a card with this dense bf16 peak (None when unknowable)."""
    tokens = training_tokens(cfg)
    if tokens is None or not bf16_tflops:
        return None
    flops = tokens * flops_per_token(spec.active_params, cfg.train.gradient_checkpointing)
    return flops / (bf16_tflops * 1e12 * MFU)


@dataclass(frozen=True)
class Estimate:
    """What `launch --dry-run` states about time and money; `basis` says where the training
    time came from, `mfu` is the one assumed (or, when measured, the one implied)."""

    card: str | None
    usd_per_hour: float | None
    training_tokens: int | None
    estimated_train_s: float | None
    estimated_eval_s: float
    setup_s: float
    mfu: float | None = MFU
    basis: str = ""

    @property
    def total_s(self) -> float | None:
        if self.estimated_train_s is None:
            return None
        return self.setup_s + self.estimated_train_s + self.estimated_eval_s

    @property
    def estimated_usd(self) -> float | None:
        if self.total_s is None or self.usd_per_hour is None:
            return None
        return round(self.total_s / 3600 * self.usd_per_hour, 2)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "total_s": self.total_s, "estimated_usd": self.estimated_usd}


def estimate(
    spec: Any, cfg: RunConfig, card: Any | None, ledger: Path | str | None = None
) -> Estimate:
    """Time and cost of the run on `card` (a plan.hardware.Card, or None): from a rate the
    `ledger` measured for this step on this card when it holds one, else from FLOPs."""
    measured = None
    if ledger is not None and card is not None:
        measured = measured_rate(ledger, launch_signature(spec, cfg), card.id)
    tflops = getattr(card, "bf16_tflops", None)
    tokens = training_tokens(cfg)
    base = Estimate(
        card=getattr(card, "id", None),
        usd_per_hour=getattr(card, "usd_per_hour", None),
        training_tokens=tokens,
        estimated_train_s=estimate_train_s(spec, cfg, tflops),
        estimated_eval_s=float(cfg.lane.estimated_eval_s),
        setup_s=float(SETUP_S if cfg.lane.provider != "local" else 0),
        basis=f"MFU {MFU} of {card.id} bf16 peak" if card is not None else "no card",
    )
    return base if measured is None else from_measured(base, measured, spec, cfg, tflops)


def from_measured(
    base: Estimate, measured: Measured, spec: Any, cfg: RunConfig, tflops: float | None
) -> Estimate:
    """`base` with its training time from the measured rate, and the MFU that rate implies."""
    rate = measured.tokens_per_s
    flops = flops_per_token(spec.active_params, cfg.train.gradient_checkpointing)
    return replace(
        base,
        estimated_train_s=None if base.training_tokens is None else base.training_tokens / rate,
        mfu=round(rate * flops / (tflops * 1e12), 4) if tflops else None,
        basis=f"measured: ledger row {measured.row_id}, {rate:,.1f} tok/s on {measured.card}",
    )
