"""Issue [5/5]'s memory targets on Qwen3-30B-A3B, traced as `moetune plan --estimator
trace` runs them (slow: each trace takes 30–70 s). LoRA on attention + all experts,
batch 1, the trainer's loss (TRL's fused LM head), steady state."""

from __future__ import annotations

from typing import Any

import pytest

from moetune.config import parse_config
from moetune.model import load_spec
from moetune.plan.trace.cache import run_trace

pytestmark = pytest.mark.slow
GiB = 2**30
WEIGHTS = 61_064_245_760  # the bf16 frozen weights of Qwen3-30B-A3B


def trace_gib(lora: dict[str, Any], train: dict[str, Any], model: dict[str, Any] | None = None):
    lora = {"targets": ["attention", "experts"], **lora}
    cfg = parse_config({"lora": lora, "train": train, "model": model or {}})
    return run_trace(load_spec("Qwen/Qwen3-30B-A3B"), cfg).peak_bytes / GiB


def test_seq_16384_with_checkpointing_fits_an_80gb_card() -> None:
    assert trace_gib({}, {"seq_len": 16384}) <= 74


def test_above_the_weights_without_checkpointing_is_under_0_6_of_peft() -> None:
    no_gc = {"seq_len": 2048, "gradient_checkpointing": False}
    ours = trace_gib({}, no_gc) - WEIGHTS / GiB
    vanilla = trace_gib({"engine": "peft", "expert_mapping": "automap"}, no_gc) - WEIGHTS / GiB
    assert ours <= 0.6 * vanilla


@pytest.mark.parametrize(("expert_rank", "target"), [(None, 28), (4, 22)])
def test_nf4_experts_fit_32gb_and_24gb_cards(expert_rank: int | None, target: float) -> None:
    nf4 = {"experts_dtype": "nf4", "experts_double_quant": True}
    assert trace_gib({"expert_rank": expert_rank}, {"seq_len": 2048}, nf4) <= target
