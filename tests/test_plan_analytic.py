"""The analytic estimator: components, monotonicity, methods, and agreement with the trace."""

from __future__ import annotations

from typing import Any

import pytest

from moetune.config import RunConfig, parse_config
from moetune.model import load_spec, spec_from_config
from moetune.model.spec import ModelSpec
from moetune.model.tiny import tiny_config
from moetune.plan.analytic import COMPONENTS, estimate_step
from moetune.plan.fit import analytic
from moetune.plan.layout import formula_layout
from moetune.plan.step import Step

GiB = 1024**3


def cfg(**train: Any) -> RunConfig:
    lora = train.pop("lora", {})
    return parse_config({"lora": lora, "train": train})


@pytest.fixture(scope="module")
def olmoe() -> ModelSpec:
    return load_spec("allenai/OLMoE-1B-7B-0924")


def test_components_sum_to_peak(olmoe: ModelSpec) -> None:
    for gc in (True, False):
        est = analytic(olmoe, cfg(seq_len=2048, gradient_checkpointing=gc))
        assert set(est.components) == set(COMPONENTS)
        assert sum(est.components.values()) == est.peak_bytes
        assert est.peak_bytes == max(est.phases.values())


def test_olmoe_numbers(olmoe: ModelSpec) -> None:
    est = analytic(olmoe, cfg(seq_len=2048, lora={"rank": 16, "engine": "peft"}))
    # 6.92 B params in bf16; 7.6 M LoRA parameters in each of the 16 layers at r=16
    assert est.components["frozen_weights"] == olmoe.total_params * 2
    assert est.trainable_params == 121_634_816
    assert est.components["trainable_weights"] == est.trainable_params * 4
    assert est.components["optimizer_state"] == est.trainable_params * 8  # steady state
    # the trace measured 16.14 GiB for this step (benchmarks/planner_accuracy.py)
    assert est.peak_bytes / GiB == pytest.approx(16.16, rel=0.01)


def test_more_rank_longer_seq_or_no_checkpointing_never_costs_less(olmoe: ModelSpec) -> None:
    base = analytic(olmoe, cfg(seq_len=1024, lora={"rank": 16})).peak_bytes
    assert analytic(olmoe, cfg(seq_len=1024, lora={"rank": 64})).peak_bytes > base
    assert analytic(olmoe, cfg(seq_len=4096, lora={"rank": 16})).peak_bytes > base
    no_gc = cfg(seq_len=1024, gradient_checkpointing=False, lora={"rank": 16})
    assert analytic(olmoe, no_gc).peak_bytes > base
    assert analytic(olmoe, cfg(seq_len=1024, batch_size=4, lora={"rank": 16})).peak_bytes > base


def test_full_costs_more_than_lora(olmoe: ModelSpec) -> None:
    lora = analytic(olmoe, cfg(seq_len=2048))
    full = analytic(olmoe, cfg(seq_len=2048, tuning="full"))
    assert full.trainable_params == olmoe.total_params
    assert full.components["frozen_weights"] == 0
    # bf16 weights + bf16 grads + two bf16 moments = 8 B per parameter at least
    assert full.peak_bytes >= 8 * olmoe.total_params > lora.peak_bytes


def test_qlora_on_moe_costs_more_than_bf16_lora(olmoe: ModelSpec) -> None:
    lora = analytic(olmoe, cfg(seq_len=2048))
    qlora = analytic(olmoe, cfg(seq_len=2048, tuning="qlora"))
    # bnb leaves the fused experts bf16 and prepare_model_for_kbit_training upcasts them
    experts = olmoe.components.routed_experts
    assert qlora.components["frozen_weights"] > experts * 4
    assert qlora.peak_bytes > lora.peak_bytes


def test_vanilla_peft_doubles_gate_up_rank() -> None:
    spec = load_spec("Qwen/Qwen3-30B-A3B")
    targets = ["attention", "experts"]
    auto = analytic(spec, cfg(lora={"rank": 16, "targets": targets, "expert_mapping": "automap"}))
    explicit = analytic(spec, cfg(lora={"rank": 16, "targets": targets}))
    assert auto.trainable_params == 994_836_480  # docs/knowledge.md §3
    assert explicit.trainable_params == 642_514_944
    assert auto.peak_bytes - explicit.peak_bytes > 16 * (994_836_480 - 642_514_944) * 0.9


def test_foreach_adamw_adds_one_full_size_temporary() -> None:
    spec = spec_from_config(tiny_config("olmoe"), "tiny")
    layout = formula_layout(spec, parse_config({}).lora)
    fused = estimate_step(spec, Step(seq_len=8, optimizer="fused"), layout)
    foreach = estimate_step(spec, Step(seq_len=8, optimizer="foreach"), layout)
    assert foreach.phases["optimizer"] - fused.phases["optimizer"] == 4 * layout.trainable_params


def test_formula_layout_matches_peft_for_gqa() -> None:
    spec = load_spec("Qwen/Qwen3-30B-A3B")
    lora = parse_config({"lora": {"targets": ["attention", "experts"]}}).lora
    assert formula_layout(spec, lora).trainable_params == 642_514_944


@pytest.mark.parametrize(
    "variant",
    ["qwen2_moe-shared-dense0", pytest.param("qwen3_moe-dense0", marks=pytest.mark.slow)],
)
def test_tiny_models_agree_with_the_trace(variant: str) -> None:
    from moetune.plan.trace.cache import run_trace

    spec = spec_from_config(tiny_config(variant), variant)
    run = cfg(seq_len=64, lora={"rank": 4})
    est, trace = analytic(spec, run), run_trace(spec, run)
    assert est.trainable_params == trace.trainable_params
    assert est.peak_bytes == pytest.approx(trace.peak_bytes, rel=0.05)


def test_split_lora_counts_the_w_plus_dw_of_shared_and_dense_weights() -> None:
    """Split LoRA takes over the routed stacks only: a shared expert's or the dense MLP's
    weight targeted as a parameter stays peft's ParamWrapper and keeps W+ΔW for backward
    (DeepSeek-V2-Lite's ≈ 1 GiB without checkpointing). Adding those targets raises the
    analytic peak by what it raises the trace's."""
    from moetune.plan.trace.cache import run_trace

    spec = spec_from_config(tiny_config("deepseek_v2-lite-like"), "deepseek_v2-lite-like")
    peaks = {}
    for targets in (("attention", "experts"), ("attention", "experts", "dense", "shared")):
        run = cfg(seq_len=64, gradient_checkpointing=False,
                  lora={"rank": 4, "targets": list(targets)})  # fmt: skip
        assert analytic(spec, run).peak_phase == "loss"  # every layer's keep-set is live
        peaks[targets] = (analytic(spec, run).peak_bytes, run_trace(spec, run).peak_bytes)
    (a0, t0), (a1, t1) = peaks.values()
    assert a1 - a0 == pytest.approx(t1 - t0, rel=0.02)
