"""The data preview of a run: `moetune data` and the one line `moetune train` prints before
the first step – the data summary (moetune.data.summary) with the estimated time of a step
on the configured card (plan/cost/estimate.py's FLOPs per token at its calibrated MFU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moetune.data.summary import Summary, summarize
from moetune.data.tokenizer import run_tokenizer
from moetune.model import load_spec
from moetune.plan.cost.estimate import MFU, flops_per_token
from moetune.plan.hardware import get_card
from moetune.train.methods import method_of
from moetune.train.setup import check_data

if TYPE_CHECKING:
    from moetune.config import RunConfig


@dataclass(frozen=True)
class Preview:
    summary: Summary
    card: str | None
    step_s: float | None  # analytic, on hardware.card; None without a card

    def to_json(self) -> dict[str, Any]:
        return {**self.summary.to_json(), "card": self.card, "estimated_step_s": self.step_s}

    def one_line(self) -> str:
        step = f" · ~{self.step_s:.3g} s/step on {self.card}" if self.step_s else ""
        return self.summary.one_line() + step


def tokens_per_step(cfg: RunConfig, summary: Summary) -> float:
    """Mean tokens of a row (within seq_len) times the global batch."""
    t = cfg.train
    rows = sum(h["rows"] for h in summary.histogram) or 1
    mean = sum(min(h["upto"] or t.seq_len, t.seq_len) * h["rows"] for h in summary.histogram)
    return mean / rows * t.batch_size * t.grad_accum * t.nproc * t.nnodes


def step_seconds(cfg: RunConfig, summary: Summary) -> float | None:
    """Analytic seconds per optimizer step on hardware.card (bins' upper edges: errs long)."""
    if not cfg.hardware.card:
        return None
    spec, card = load_spec(cfg.model.id), get_card(cfg.hardware.card)
    if not card.tensor_tflops:  # a card given by its memory: no rate to time it by
        return None
    flops = tokens_per_step(cfg, summary) * flops_per_token(
        spec.active_params, cfg.train.gradient_checkpointing
    )
    return flops / (card.tensor_tflops * 1e12 * MFU * cfg.train.nproc * cfg.train.nnodes)


def preview(cfg: RunConfig) -> Preview:
    """The data summary of a run config, read exactly as training reads it, with the
    tokenizer training uses (refused as training refuses it: no weight loads)."""
    formats = method_of(cfg).formats
    rows = check_data(cfg, formats)
    spec = load_spec(cfg.model.id, cfg.model.trust_remote_code)
    tok = run_tokenizer(cfg, spec.vocab_size, rows[0][0] if rows[0] else None)
    summary = summarize(cfg, tok, formats, rows)
    return Preview(summary, cfg.hardware.card, step_seconds(cfg, summary))
