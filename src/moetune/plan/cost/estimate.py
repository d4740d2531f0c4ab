"""Time and money a run will take on a card, before anything is rented.

Training FLOPs per token of a LoRA step on a frozen base: forward 2·N_active, backward
through the activations 2·N_active (no full weight gradients), plus another forward
2·N_active when gradient checkpointing recomputes it – N_active being the parameters a
token really passes (top-k experts, not all). Divided by the card's dense bf16 peak at an
MFU calibrated from a published step rate (`REFERENCE`). A measured tokens/s from an
earlier run on the same card (ledger) replaces the guess when there is one: the newest ok
train row with the same step signature (`step_signature`, written by the trainer). Its
tokens are the non-padding ones, so a rate from padded batches is lower than the card's and
the time it gives errs long, never short.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from moetune.config import RunConfig
from moetune.ledger import Ledger, select
from moetune.plan.hardware import get_card

# Without a tokenizer: bytes of text per token of the BPE vocabularies MoE families ship
# (Qwen, DeepSeek, Mixtral, gpt-oss, OLMoE: ~3.5-4 on English). Low end, so counts err high.
BYTES_PER_TOKEN = 3.6
TEXT_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".txt")  # compressed formats: unknown


@dataclass(frozen=True)
class Published:
    """A published training step rate the default MFU is derived from (docs/knowledge.md §4)."""

    what: str
    card: str  # catalog id of the card it ran on
    tokens_per_s: float
    active_params: float


# Vendor table: Qwen3-30B-A3B (3.3B active) LoRA on one H100, seq 2048, 745 ms/step.
REFERENCE = Published(
    "Qwen3-30B-A3B LoRA, transformers v5 + TRL, seq 2048, 745 ms/step",
    "H100-80GB",
    tokens_per_s=2048 / 0.745,
    active_params=3.3e9,
)


def calibrated_mfu(ref: Published = REFERENCE) -> float:
    """The MFU `ref` implies, its FLOPs counted without recompute (4·N_active per token):
    the table does not say whether it checkpointed, and the lower reading errs long."""
    peak = get_card(ref.card).tensor_tflops * 1e12
    return round(ref.tokens_per_s * flops_per_token(int(ref.active_params), False) / peak, 4)


def flops_per_token(active_params: int, gradient_checkpointing: bool) -> float:
    return (6.0 if gradient_checkpointing else 4.0) * active_params


MFU = calibrated_mfu()  # scaled by each card's own peak (bf16; fp16 where it has no bf16)


@dataclass(frozen=True)
class Tokens:
    """How many tokens a run processes at most, and how that was counted."""

    count: int
    basis: str


def _rows(path: str | None) -> int | None:
    """Rows of a local JSONL training file (other formats: unknown)."""
    if not path or not Path(path).is_file() or not path.endswith(".jsonl"):
        return None
    with Path(path).open("rb") as fh:
        return sum(1 for line in fh if line.strip())


def _text_bytes(path: str | None) -> int | None:
    """Size of a local uncompressed text training file (None for anything else)."""
    if not path or not Path(path).is_file() or not path.endswith(TEXT_SUFFIXES):
        return None
    return Path(path).stat().st_size or None


def token_count(cfg: RunConfig) -> Tokens | None:
    """Steps × batch × accumulation × sequence length when the steps are known (set, or
    from the rows of every source, by weight); else the data's bytes over BYTES_PER_TOKEN;
    else None (a hub id, a folder, parquet: nothing to count without reading it)."""
    t = cfg.train
    per_step = t.batch_size * t.grad_accum * t.seq_len
    if t.max_steps is not None:
        return Tokens(t.max_steps * per_step, f"{t.max_steps} steps × {per_step} tokens")
    rows = _weighted(cfg, _rows, cap_rows=True)
    if rows is not None:
        steps = math.ceil(rows / (t.batch_size * t.grad_accum)) * t.epochs
        return Tokens(int(steps * per_step), f"{rows} rows → {steps} steps × {per_step} tokens")
    size = _weighted(cfg, _text_bytes, cap_rows=False)
    if size is None:
        return None
    count = math.ceil(size / BYTES_PER_TOKEN * t.epochs)
    why = f"{size:,} bytes / {BYTES_PER_TOKEN} bytes per token (BPE; no tokenizer) × {t.epochs:g}"
    return Tokens(count, why + " epochs")


def _weighted(
    cfg: RunConfig, measure: Callable[[str | None], int | None], *, cap_rows: bool
) -> int | None:
    """`measure` (rows or bytes) summed over the training sources as the mix takes them
    (each × its weight, capped by max_rows when `cap_rows` – a count of rows –, less the
    eval fraction); None when any source cannot be measured."""
    total = 0.0
    for src in cfg.data.train_sources():
        got = measure(src.path)
        if got is None:
            return None
        if src.max_rows and cap_rows:
            got = min(got, src.max_rows)
        total += got * src.weight
    return round(total * (1 - cfg.data.eval_fraction)) or None


def training_tokens(cfg: RunConfig) -> int | None:
    """Tokens the run processes at most (`token_count`'s number)."""
    counted = token_count(cfg)
    return None if counted is None else counted.count


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
    # lazy: heavy to import (torch, peft via moetune.engine)
    from moetune.engine.resolve import resolve_engine

    engine = resolve_engine(spec, cfg.lora, cfg.model.experts_dtype, cfg.model.quantized_base)
    return step_signature(cfg, engine, cfg.lane.runpod.gpu_count or cfg.train.nproc)


@dataclass(frozen=True)
class Measured:
    """A training rate from the ledger: which row, how fast, on which card."""

    row_id: str
    tokens_per_s: float
    card: str


def _measured_rows(ledger: Path | str, signature: dict[str, Any]) -> list[Any]:
    """Ok train rows that measured a rate for this step signature (any card)."""
    return [
        r
        for r in select(Ledger(ledger).read().rows, kind="train", status="ok")
        if r.metrics.get("signature") == signature and (r.metrics.get("tokens_per_s") or 0) > 0
    ]


def measured_cards(ledger: Path | str, signature: dict[str, Any]) -> set[str]:
    """The cards a run of this step signature has really trained on (ledger)."""
    return {
        str(r.metrics["card"]) for r in _measured_rows(ledger, signature) if r.metrics.get("card")
    }


def measured_rate(ledger: Path | str, signature: dict[str, Any], card_id: str) -> Measured | None:
    """The newest ok train row with this step signature on this card, else None."""
    rows = [r for r in _measured_rows(ledger, signature) if r.metrics.get("card") == card_id]
    newest = max(rows, key=lambda r: r.time, default=None)
    if newest is None:
        return None
    return Measured(newest.id, float(newest.metrics["tokens_per_s"]), card_id)


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
    time came from (the rate, then the token count), `mfu` is the one assumed (or, when
    measured, the one implied)."""

    card: str | None
    usd_per_hour: float | None
    training_tokens: int | None
    estimated_train_s: float | None
    estimated_eval_s: float
    setup_s: float
    mfu: float | None = MFU
    rate_basis: str = ""
    tokens_basis: str = ""

    @property
    def basis(self) -> str:
        return f"{self.rate_basis}; tokens: {self.tokens_basis}" if self.tokens_basis else (
            self.rate_basis
        )  # fmt: skip

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
        extra = {"basis": self.basis, "total_s": self.total_s}
        return {**asdict(self), **extra, "estimated_usd": self.estimated_usd}


def estimate(
    spec: Any,
    cfg: RunConfig,
    card: Any | None,
    ledger: Path | str | None = None,
    setup_s: float = 0.0,
) -> Estimate:
    """Time and cost of the run on `card` (a plan.hardware.Card, or None): from a rate the
    `ledger` measured for this step on this card when it holds one, else from FLOPs.
    `setup_s` is the paid time before the first step (the provider's, from the lane)."""
    measured = None
    if ledger is not None and card is not None:
        measured = measured_rate(ledger, launch_signature(spec, cfg), card.id)
    tflops = getattr(card, "tensor_tflops", None)
    tokens = token_count(cfg)
    base = Estimate(
        card=getattr(card, "id", None),
        usd_per_hour=getattr(card, "usd_per_hour", None),
        training_tokens=None if tokens is None else tokens.count,
        estimated_train_s=estimate_train_s(spec, cfg, tflops),
        estimated_eval_s=float(cfg.lane.estimated_eval_s),
        setup_s=setup_s,
        rate_basis=mfu_basis(card),
        tokens_basis="" if tokens is None else tokens.basis,
    )
    return base if measured is None else from_measured(base, measured, spec, cfg, tflops)


def mfu_basis(card: Any | None) -> str:
    if card is None:
        return "no card"
    ref = REFERENCE
    if not getattr(card, "tensor_tflops", None):  # a card given by its memory
        return f"no estimate: {card.id} has no known TFLOPS"
    dtype = getattr(card, "compute_dtype", "bf16")  # fp16 where the card has no bf16
    return f"MFU {MFU} of {card.id} {dtype} peak (from {ref.what} on {ref.card})"


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
        rate_basis=f"measured: ledger row {measured.row_id}, {rate:,.1f} tok/s on {measured.card}",
    )
