"""Time and money a run will take on a card, before anything is rented.

Training FLOPs per token of a LoRA step on a frozen base: forward 2·N_active, backward
through the activations 2·N_active (no full weight gradients), plus another forward
2·N_active when gradient checkpointing recomputes it – N_active being the parameters a
token really passes (top-k experts, not all). Divided by the card's dense bf16 peak at a
stated efficiency. A measured tokens/s from an earlier run on the same card (ledger)
replaces the guess when there is one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from moetune.config import RunConfig

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
    """What `launch --dry-run` states about time and money."""

    card: str | None
    usd_per_hour: float | None
    training_tokens: int | None
    estimated_train_s: float | None
    estimated_eval_s: float
    setup_s: float
    mfu: float = MFU

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


def estimate(spec: Any, cfg: RunConfig, card: Any | None) -> Estimate:
    """Time and cost of the run on `card` (a plan.hardware.Card, or None)."""
    tflops = getattr(card, "bf16_tflops", None)
    return Estimate(
        card=getattr(card, "id", None),
        usd_per_hour=getattr(card, "usd_per_hour", None),
        training_tokens=training_tokens(cfg),
        estimated_train_s=estimate_train_s(spec, cfg, tflops),
        estimated_eval_s=float(cfg.lane.estimated_eval_s),
        setup_s=float(SETUP_S if cfg.lane.provider != "local" else 0),
    )
