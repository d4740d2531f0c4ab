"""Serving rules speak only when output.serve_with names the stack and LoRA reaches the
experts; each says what happens there and points at the export that avoids it."""

from __future__ import annotations

from typing import Any

import pytest

from test_rules import DSV2, check, ctx


def _serve(stack: str, model: str = "Qwen/Qwen3-30B-A3B", **lora: Any) -> Any:
    return ctx(
        model, output={"serve_with": [stack]}, lora={"targets": ["attention", "experts"], **lora}
    )


@pytest.mark.parametrize(
    ("model", "export"),
    [("mistralai/Mixtral-8x7B-v0.1", "--format gguf"), (DSV2, "--format merged")],
)
def test_gguf_rule_points_at_the_export_the_family_has(model: str, export: str) -> None:
    f = check("SERVE-GGUF-CONVERTER", _serve("llama.cpp", model))
    assert f and f.fix.startswith(f"moetune export RUN {export}")


def test_vllm_2d_family_warns_with_the_per_expert_export() -> None:
    f = check("SERVE-VLLM-3D", _serve("vllm"))
    assert f and f.severity == "warn" and "2-D MoE LoRA wrapper" in f.message
    assert "--format vllm" in f.fix and "is_3d_lora_weight=True" in f.fix


def test_vllm_3d_family_and_attention_only_are_fine() -> None:
    assert check("SERVE-VLLM-3D", _serve("vllm", "openai/gpt-oss-20b")) is None
    assert check("SERVE-VLLM-3D", _serve("vllm", targets=["attention"])) is None
    assert check("SERVE-VLLM-3D", ctx()) is None  # nothing served: quiet


@pytest.mark.parametrize(
    ("rule_id", "stack", "words"),
    [
        ("SERVE-GGUF-CONVERTER", "llama.cpp", "Unprocessed experts"),
        ("SERVE-UNMERGED-EXPERTS", "peft", "whole expert stack"),
    ],
)
def test_other_stacks(rule_id: str, stack: str, words: str) -> None:
    f = check(rule_id, _serve(stack))
    assert f and words in f.message and "moetune export" in f.fix
    assert check(rule_id, _serve("vllm" if stack != "vllm" else "peft")) is None
