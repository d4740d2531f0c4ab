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


def _fp8_base(tmp_path: Any, **widths: int) -> Any:
    import json

    config = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 256,
              "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 4,
              "num_experts_per_tok": 2, "first_k_dense_replace": 1, "q_lora_rank": 1536,
              "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
              "v_head_dim": 128, "n_group": 1, "topk_group": 1, **widths,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                      "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = RunConfig.model_validate({"model": {"id": str(tmp_path)}, "lora": {"rank": 16}})
    return RULES.get("QUANT-FP8-PARTIAL-BLOCK").check(
        LintContext(config=cfg, spec=load_spec(str(tmp_path)), env={}, versions={})
    )


def test_partial_fp8_blocks_named(tmp_path: Any) -> None:
    """DeepSeek's kv_a_proj_with_mqa (512 + 64 rows) ends in a partial 128-row block."""
    finding = _fp8_base(tmp_path)
    assert finding is not None and "kv_lora_rank + qk_rope_head_dim 576" in finding.message
    assert "hidden_size" not in finding.message and finding.field == "model.id"


def test_whole_fp8_blocks_silent(tmp_path: Any) -> None:
    assert _fp8_base(tmp_path, kv_lora_rank=448) is None  # 448 + 64 = 512: whole blocks
