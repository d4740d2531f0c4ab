"""QUANT-BASE-INFLATED: a base published quantised, inflated for training, is named with the
bytes it costs; kept as stored (the default) or a float base, the rule is silent."""

from __future__ import annotations

from functools import cache
from typing import Any

from moetune.config import RunConfig
from moetune.lint import RULES, LintContext
from moetune.model import load_spec
from moetune.model.spec import ModelSpec


@cache
def spec(model_id: str) -> ModelSpec:
    return load_spec(model_id)


def check(model: str, **model_args: Any) -> Any:
    cfg = RunConfig.model_validate({"model": {"id": model, **model_args}, "lora": {"rank": 16}})
    return RULES.get("QUANT-BASE-INFLATED").check(
        LintContext(config=cfg, spec=spec(model), env={}, versions={})
    )


def test_inflating_gpt_oss_is_named_with_its_bytes() -> None:
    finding = check("openai/gpt-oss-20b", quantized_base="dequantize")
    assert finding is not None and finding.severity == "warn"
    assert "MXFP4" in finding.message and finding.field == "model.quantized_base"
    routed = spec("openai/gpt-oss-20b").components.routed_experts
    assert f"{routed * 2 / 2**30:,.1f} GiB)" in finding.message  # the bf16 stacks it asks for
    assert f"({routed * (0.5 + 1 / 32) / 2**30:,.1f} GiB stored" in finding.message
    assert "as_stored" in finding.fix


def test_silent_as_stored_and_on_float_bases() -> None:
    assert check("openai/gpt-oss-20b") is None
    assert check("deepseek-ai/DeepSeek-V3") is None
    assert check("Qwen/Qwen3-30B-A3B", quantized_base="dequantize") is None


def test_fp8_base_inflated_is_named() -> None:
    finding = check("deepseek-ai/DeepSeek-V3", quantized_base="dequantize")
    assert finding is not None and "block FP8" in finding.message
