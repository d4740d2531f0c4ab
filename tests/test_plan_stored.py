"""A published quantised base is planned by its stored bytes: routed experts at the format's
bytes per parameter, everything else at model.dtype (dequantised at load)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import RunConfig, parse_config
from moetune.engine.resolve import resolve_engine
from moetune.model import load_spec, spec_from_config
from moetune.model.spec import ModelSpec
from moetune.plan import make_plan
from moetune.plan.devices.sharding import run_sizes
from moetune.plan.fit import analytic
from moetune.plan.offload.memory import plan_offload
from moetune.plan.step import Step

MXFP4 = {"quant_method": "mxfp4"}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
# 2 layers × 16 experts × (gate, up, down) × 96 × 64
ROUTED = 2 * 16 * 3 * 96 * 64


def small(quant: dict[str, Any] | None) -> ModelSpec:
    config: dict[str, Any] = {
        "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "moe_intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 16, "num_experts_per_tok": 2, "max_position_embeddings": 512,
    }  # fmt: skip
    if quant:
        config["quantization_config"] = quant
    return spec_from_config(config, f"small-{(quant or {}).get('quant_method', 'bf16')}")


def run(**model: Any) -> RunConfig:
    return parse_config({
        "model": model,
        "lora": {"targets": ["attention", "experts"]},
        "train": {"seq_len": 64},
    })  # fmt: skip


def test_the_spec_keeps_the_whole_quantization_config() -> None:
    spec = small(FP8)
    assert spec.quant_config == FP8 and spec.quant_method == "fp8"
    assert "quantization_config" not in spec.hf_config  # the float build
    assert spec.components.routed_experts == ROUTED
    assert small(None).quant_config is None and small(None).quant_method is None


@pytest.mark.parametrize(("quant", "per_param"), [(MXFP4, 0.53125), (FP8, 1 + 4 / 128**2)])
def test_frozen_bytes_are_the_stored_experts_and_the_rest_at_bf16(
    quant: dict[str, Any], per_param: float
) -> None:
    spec = small(quant)
    step = Step.from_config(run(), spec)
    assert step.stored_bytes == per_param and step.split_lora
    # FP8's publishers quantise the attention Linears too (kept as stored); MXFP4's do not
    linears = spec.components.attention if quant is FP8 else 0
    assert step.stored_linear_bytes == (per_param if linears else 0)
    rest = spec.total_params - ROUTED - linears
    frozen = analytic(spec, run()).components["frozen_weights"]
    assert frozen == (ROUTED + linears) * per_param + rest * 2
    # dequantize: everything at model.dtype, as a float checkpoint of the same model
    inflated = analytic(spec, run(quantized_base="dequantize")).components["frozen_weights"]
    assert inflated == spec.total_params * 2
    assert inflated == analytic(small(None), run()).components["frozen_weights"]


def test_a_base_kept_as_stored_trains_on_the_split_engine() -> None:
    spec = small(MXFP4)
    lora = run().lora.model_copy(update={"targets": ["attention"]})
    assert resolve_engine(spec, lora) == "moetune"  # the stored stacks need the split forward
    assert resolve_engine(spec, lora, quantized_base="dequantize") == "peft"
    assert resolve_engine(small(None), lora) == "peft"
    assert resolve_engine(small({"quant_method": "no-such-method"}), lora) == "peft"  # unreadable


def test_int8_or_nf4_experts_restore_a_stored_base() -> None:
    spec = small(FP8)
    step = Step.from_config(run(experts_dtype="nf4"), spec)
    assert step.stored_bytes == 0 and step.experts_quantised
    nf4 = analytic(spec, run(experts_dtype="nf4")).components["frozen_weights"]
    assert nf4 == ROUTED * (0.5 + 4 / 64) + (spec.total_params - ROUTED) * 2


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_offload_moves_the_stored_bytes(offload: str) -> None:
    spec = small(MXFP4)
    cfg = run()
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"offload": offload})})
    plan = plan_offload(spec, cfg, "H100-80GB")
    layer = 156_672  # one MoE layer's 294,912 routed parameters × 0.53125 B
    assert plan.layer_expert_bytes == layer and plan.offloaded_bytes == 2 * layer
    # cpu: every MoE layer's stacks pinned (2 layers here); disk: two layers' staging buffers
    assert plan.pinned_host_bytes == 2 * layer
    assert plan.disk_bytes == (2 * layer if offload == "disk" else 0)
    # every MoE layer's stacks, forward, recompute (checkpointing on) and backward
    assert plan.bytes_moved_per_step == {"forward": 2 * layer, "recompute": 2 * layer,
                                         "backward": 2 * layer}  # fmt: skip
    assert plan.device_components["streamed_experts"] == 2 * layer
    dense = plan_offload(small(None), cfg, "H100-80GB")
    assert dense.layer_expert_bytes == ROUTED // 2 * 2  # the bf16 stacks, for contrast


def test_sharding_sizes_hold_the_stored_layer() -> None:
    spec, cfg = small(MXFP4), run()
    sizes = run_sizes(spec, cfg)
    float_sizes = run_sizes(spec, run(quantized_base="dequantize"))
    # one layer's 294,912 routed parameters: 589,824 bytes in bf16, 156,672 as stored
    assert float_sizes.largest_layer - sizes.largest_layer == 589_824 - 156_672


def test_the_trace_counts_the_stored_stacks() -> None:
    from moetune.plan.trace.cache import run_trace, trace_key

    spec, cfg = small(MXFP4), run()
    trace = run_trace(spec, cfg)
    frozen = analytic(spec, cfg).components["frozen_weights"]
    rotary = 2 * 8 * 4  # inv_freq and original_inv_freq: head_dim / 2 fp32 each, buffers
    assert trace.at_peak["frozen_weights"] == frozen + rotary
    inflated = run(quantized_base="dequantize")
    assert trace_key(spec, cfg, "fused") != trace_key(spec, inflated, "fused")


def test_the_trace_counts_stored_linears_too() -> None:
    """FP8 (32x32 blocks, dividing every Linear here): the attention Linears are StoredLinears
    in the trace too; analytic and trace agree (the q/k norms, counted with the attention,
    stay float in both the checkpoint and the trace: a few bytes)."""
    from moetune.plan.trace.cache import run_trace

    spec, cfg = small({**FP8, "weight_block_size": [32, 32]}), run()
    frozen = analytic(spec, cfg).components["frozen_weights"]
    traced = run_trace(spec, cfg).at_peak["frozen_weights"]
    assert traced == pytest.approx(frozen, rel=1e-3)
    inflated = analytic(spec, run(quantized_base="dequantize")).components["frozen_weights"]
    assert frozen < 0.55 * inflated  # ≈ half: only embeddings, lm_head and norms stay bf16


def test_recommendations_never_inflate_a_stored_base() -> None:
    from moetune.plan.recommend import _storages

    # a published base trains as stored (or dequantised), never re-stored as int8 / NF4: the
    # adapter would learn weights the serving engine never holds (train refuses it too)
    assert _storages(run(), small(MXFP4)) == []
    assert _storages(run(), small(FP8)) == []
    assert [s.dtype for s in _storages(run(), small(None))] == ["int8", "nf4"]


def test_gpt_oss_20b_plan_json_is_by_the_stored_bytes() -> None:
    result = CliRunner().invoke(app, ["plan", "openai/gpt-oss-20b", "--card", "RTX-4090",
                                      "--seq", "2048", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    spec = load_spec("openai/gpt-oss-20b")
    routed = spec.components.routed_experts
    assert routed == 19_116_933_120
    frozen = data["components"]["frozen_weights"]
    assert frozen == int(routed * 0.53125 + (spec.total_params - routed) * 2)
    assert frozen / 2**30 == pytest.approx(12.8, abs=0.05)  # was 39.0 GiB all bf16
    stored = data["stored_experts"]
    assert stored["as_stored"] and stored["bytes_per_param"] == 0.53125
    assert stored["routed_experts_bytes"] == round(routed * 0.53125)
    assert stored["text"].startswith("routed experts as published: MXFP4, 9.5 GiB")
    assert data["fits"]["RTX-4090"] and data["settings"]["quantized_base"] == "as_stored"


def test_a_dequantized_base_is_told_to_keep_it_as_published() -> None:
    spec = load_spec("openai/gpt-oss-20b")
    cfg = parse_config({"model": {"id": "openai/gpt-oss-20b", "quantized_base": "dequantize"},
                        "train": {"seq_len": 2048}})  # fmt: skip
    plan = make_plan(spec, cfg, cards=["RTX-4090"])
    assert not plan.fits["RTX-4090"].fits and plan.stored and not plan.stored["as_stored"]
    best = plan.best["RTX-4090"]
    assert best.overrides == ("model.quantized_base=as_stored",) and best.cost == 0


@pytest.mark.parametrize(
    "quant",
    [
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True},
        {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"},
        {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
            "g": {"weights": {"num_bits": 4, "group_size": 32, "actorder": "group"}}}},
    ],
)  # fmt: skip
def test_integer_formats_trace_as_stored(quant: dict[str, Any]) -> None:
    """GPTQ / AWQ / compressed-tensors g_idx bases trace (no value-dependent check on fake
    buffers); the trace holds the analytic bytes plus g_idx (4 bytes an input column)."""
    from moetune.plan.trace.cache import run_trace

    spec, cfg = small(quant), run()
    frozen = analytic(spec, cfg).components["frozen_weights"]
    traced = run_trace(spec, cfg).at_peak["frozen_weights"]
    assert frozen <= traced < 1.06 * frozen
    inflated = analytic(spec, run(quantized_base="dequantize")).components["frozen_weights"]
    assert frozen < 0.4 * inflated
