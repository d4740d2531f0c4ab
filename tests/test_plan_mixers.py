"""The analytic's activation term by token-mixer kind, against the trace on tiny models of
each family that uses it, and the trace fallback for a kind with no calibrated term."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from moetune.config import RunConfig, parse_config
from moetune.model import spec_from_config
from moetune.model.census import shrunk_config
from moetune.model.spec import ModelSpec
from moetune.plan import make_plan
from moetune.plan.fit import analytic
from moetune.plan.profiles import PROFILES, ActivationProfile, layer_kinds, uncalibrated
from moetune.plan.tracecache import cached_trace

# (model_type, the mixer kind its layers calibrate); analytic vs trace: the bytes the layers
# keep for backward (gc off − gc on) within 5 %, the peak within 2 %
CALIBRATED = [
    ("qwen3_next", "linear_attention", {}),  # gated DeltaNet + output-gated attention
    ("qwen3_5_moe_text", "linear_attention", {}),
    ("minimax_m2", "attention", {}),  # full-width q/k norms
    ("glm4_moe_lite", "mla", {}),  # equal q/k and v head dims: the fused SDPA kernel
    ("glm4_moe_lite", "mla", {"v_head_dim": 8}),  # as released: the math kernel, s² fp32
    ("deepseek_v32", "mla", {}),  # + DSA: a top-k mask per layer, a no-grad indexer
    ("glm_moe_dsa", "mla", {}),  # the same DSA term, by the indexer in the config
    ("mistral_large4_text", "mla", {}),
    ("dots3_note_text", "mla", {}),
    ("lfm2_moe", "conv", {}),  # gated short convolution between attention layers
    ("lfm2_moe", "conv", {"hidden_size": 128}),  # the conv term scales with the width
    ("granitemoehybrid", "mamba", {}),  # Mamba2's torch chunked scan
    ("granitemoehybrid", "mamba", {"mamba_chunk_size": 16}),
    ("granitemoehybrid", "mamba", {"mamba_n_heads": 8, "mamba_d_head": 16}),
    ("granitemoehybrid", "mamba", {"mamba_d_state": 32}),  # held out of the fit: +3 % kept
    ("kimi_linear", "linear_attention", {}),  # KDA's torch chunked kernel, beside MLA
    ("minimax", "linear_attention", {}),  # lightning attention beside windowed SDPA
    ("lara_mini", "linear_attention", {}),  # gated DeltaNet; sliding layers: masked SDPA
    # split-projection gated DeltaNet + QSA-indexed attention, 4 hyper-connection streams; its
    # indexer scores one query at a time, so each trace takes ~1 min: -m slow
    *(
        pytest.param("qwen4_exp_text", kind, over, marks=pytest.mark.slow)
        for kind, over in [
            ("linear_attention", {}),
            ("linear_attention", {"linear_num_key_heads": 4}),
            # held out of the fit: 2 streams; wider value heads
            ("attention", {"hc_count": 2}),
            ("linear_attention", {"linear_value_head_dim": 32}),
        ]
    ),
    # KDA beside MLA + a pooled DSA indexer, 4 mHC streams (Sinkhorn-normalised mixing)
    *(
        pytest.param("glm5_next_text", kind, over, marks=pytest.mark.slow)
        for kind, over in [
            ("linear_attention", {}),
            ("linear_attention", {"hc_sinkhorn_iters": 10}),
            ("mla", {"hc_mult": 2, "linear_head_dim": 32}),  # held out of the fit
        ]
    ),
]
KEPT_TOLERANCE, PEAK_TOLERANCE = 0.05, 0.02


def cfg(seq: int, gc: bool, **train: object) -> RunConfig:
    raw = {"lora": {"rank": 4}, "train": {"seq_len": seq, "gradient_checkpointing": gc, **train}}
    return parse_config(raw)


def tiny(model_type: str, **over: Any) -> ModelSpec:
    return spec_from_config({**shrunk_config(model_type), **over}, model_type)


@pytest.mark.parametrize(("model_type", "kind", "over"), CALIBRATED)
def test_each_calibrated_mixer_kind_matches_the_trace(
    model_type: str, kind: str, over: dict[str, Any]
) -> None:
    spec = tiny(model_type, **over)
    assert kind in layer_kinds(spec) and uncalibrated(spec) == []
    on, off = cfg(128, True), cfg(128, False)
    est_on, est_off = analytic(spec, on).peak_bytes, analytic(spec, off).peak_bytes
    trace_on, trace_off = cached_trace(spec, on).peak_bytes, cached_trace(spec, off).peak_bytes
    # without checkpointing every layer keeps its saved set: the mixer term dominates this
    assert est_off - est_on == pytest.approx(trace_off - trace_on, rel=KEPT_TOLERANCE)
    assert est_off == pytest.approx(trace_off, rel=PEAK_TOLERANCE)


def test_linear_attention_is_most_of_what_a_hybrid_keeps() -> None:
    """Gated DeltaNet layers keep ~5× an attention layer's bytes (chunk matrices, states):
    the GQA term the family got before left 26 % of the peak out at seq 1024, gc off."""
    spec = tiny("qwen3_next")
    run = cfg(128, False)
    without = dataclasses.replace(spec, mixers=("attention",) * spec.num_layers)
    assert analytic(spec, run).peak_bytes - analytic(without, run).peak_bytes > 2_000_000


def test_hyper_connected_streams_are_what_a_checkpoint_keeps() -> None:
    """qwen4_exp_text carries 4 residual streams: a checkpoint and the gradient between layers
    are 4·H wide. The trace's peaks (seq 128, measured 2026-12-03) against the analytic; sized
    one stream wide, gc on comes out 2.2 % low (at seq 128 the LM-head tile is most of it)."""
    spec = tiny("qwen4_exp_text")
    assert uncalibrated(spec) == [] and spec.hf_config["hc_count"] == 4
    on, off = analytic(spec, cfg(128, True)), analytic(spec, cfg(128, False))
    assert on.peak_bytes == pytest.approx(10_206_684, rel=PEAK_TOLERANCE)
    assert off.peak_bytes == pytest.approx(18_950_188, rel=PEAK_TOLERANCE)
    one = ActivationProfile(**{**vars(PROFILES["qwen4_exp_text"]), "streams": lambda _: 1})
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PROFILES, "qwen4_exp_text", one)
        narrow = analytic(spec, cfg(128, True)).peak_bytes
    assert narrow < (1 - PEAK_TOLERANCE) * 10_206_684


def test_hybrid_terms_are_the_saved_bytes_read_off_the_trace() -> None:
    """Per-token bytes the trace's modules saved (saved_tensors_hooks, seq 128 and 256 to take
    the weights out; measured 2026-12-03): the hyper-connection and split-DeltaNet terms give
    them to the byte."""
    from moetune.plan import terms_hybrid as hybrid

    measured = [
        (hybrid.mhc, "glm5_next_text", {}, 4452 + 512),  # 4 streams, 20 Sinkhorn iterations
        (hybrid.mhc, "glm5_next_text", {"hc_sinkhorn_iters": 10}, 2852 + 512),
        (hybrid.gated_residual, "qwen4_exp_text", {}, 2136),  # 4 streams × 64
        (hybrid.gated_residual, "qwen4_exp_text", {"hc_count": 2}, 1100),
        (hybrid.split_delta_net, "qwen4_exp_text", {}, 9032),  # 2 key heads, 4 value heads
        (hybrid.split_delta_net, "qwen4_exp_text", {"linear_num_key_heads": 4}, 9160),
    ]
    for term, model_type, over, saved in measured:
        assert term(tiny(model_type, **over)) == saved, (term.__name__, over)


def test_kimi_delta_attention_is_read_as_linear_attention_beside_mla() -> None:
    """KimiLinearAttention is kimi_linear's MLA and KimiLinearDeltaAttention its KDA: read by
    class name they once came out swapped, and the KDA layers were sized as GQA (73 % low)."""
    for model_type in ("kimi_linear", "bailing_hybrid"):
        spec = tiny(model_type)
        full = [t == "full_attention" for t in spec.hf_config["layer_types"]]
        assert layer_kinds(spec) == tuple("mla" if f else "linear_attention" for f in full)
        assert uncalibrated(spec) == []  # bailing_hybrid runs the same KDA kernel: one term


def test_an_uncalibrated_mixer_kind_plans_with_the_trace_and_says_so() -> None:
    spec = tiny("nemotron_h")
    assert "mamba" in uncalibrated(spec)
    run = cfg(64, True)
    plan = make_plan(spec, run, cards=["H200"], estimator="analytic")
    assert plan.estimator == "trace" and plan.requested == "analytic"
    assert plan.peak_bytes == cached_trace(spec, run).peak_bytes
    assert plan.peak_op is not None  # the trace names the op at the peak
    assert "no calibrated activation term" in plan.notes[0] and "mamba" in plan.notes[0]
    doc = plan.to_json()
    assert doc["estimator"] == "trace" and doc["estimator_requested"] == "analytic"
    assert doc["notes"][0] == plan.notes[0]


def test_a_failed_fallback_trace_keeps_the_analytic_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from moetune.errors import TraceError
    from moetune.plan import tracecache

    def fail(*_: object, **__: object) -> None:
        raise TraceError("the training-step trace failed at aten.nonzero", "check the config")

    monkeypatch.setattr(tracecache, "cached_trace", fail)
    spec, run = tiny("nemotron_h"), cfg(64, True)
    plan = make_plan(spec, run, cards=["H200"], estimator="analytic")
    assert plan.estimator == "analytic" and plan.requested is None
    assert plan.peak_bytes == analytic(spec, run).peak_bytes
    assert "trace failed" in plan.notes[0] and "aten.nonzero" in plan.notes[0]


def test_a_calibrated_spec_stays_analytic() -> None:
    plan = make_plan(tiny("qwen3_next"), cfg(64, True), cards=["H200"], estimator="analytic")
    assert plan.estimator == "analytic" and plan.requested is None
    assert plan.to_json()["estimator_requested"] == "analytic"
    assert any("gated-delta" in n for n in plan.notes)  # which kernel the term sizes


def test_a_quantized_step_cannot_trace_and_says_what_the_analytic_leaves_out() -> None:
    spec = tiny("nemotron_h")
    plan = make_plan(spec, cfg(64, True, tuning="qlora"), cards=["H200"], estimator="analytic")
    assert plan.estimator == "analytic"
    assert "cannot be traced" in plan.notes[0] and "mamba" in plan.notes[0]


def test_an_unknown_kind_in_a_known_family_is_uncalibrated() -> None:
    spec = tiny("minimax_m2")
    odd = dataclasses.replace(spec, mixers=("attention", "retention", "attention", "attention"))
    assert uncalibrated(odd) == ["retention"]
    assert uncalibrated(dataclasses.replace(spec, mixers=())) == []  # every layer: attention


def test_an_indexer_family_with_more_than_dsa_keeps_the_trace() -> None:
    """axk2 / hy_v4 are MLA + an indexer too, but keep more than the DSA term sizes (a gated
    input norm, hyper-connections): they stay uncalibrated rather than planned 5-25 % low."""
    assert uncalibrated(tiny("glm_moe_dsa")) == []
    for model_type in ("axk2", "hy_v4"):
        assert uncalibrated(tiny(model_type)) == ["mla"]


def test_a_fallback_to_the_trace_warns_before_it_starts_with_the_expected_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """jamba's analytic once fell back to a 432 s trace without a word: the warning comes
    first (before the trace runs), names the kinds and the expected time, and the JSON
    holds the same."""
    from moetune.plan import planner, tracecache

    monkeypatch.setenv("MOETUNE_CACHE_DIR", str(tmp_path))  # nothing cached: a real wait
    spec, run = tiny("nemotron_h"), cfg(64, True)
    said: list[str] = []
    real = tracecache.cached_trace

    def traced(*args: Any, **kwargs: Any) -> Any:
        said.append("trace started")
        return real(*args, **kwargs)

    monkeypatch.setattr(tracecache, "cached_trace", traced)
    plan = planner.make_plan(spec, run, cards=["H200"], estimator="analytic", warn=said.append)
    assert plan.estimator == "trace" and said[-1] == "trace started" and len(said) == 2
    assert "mamba" in said[0] and "expected ~" in said[0] and "seq 64" in said[0]
    doc = plan.to_json()["fallback"]
    assert doc["warning"] == said[0] and doc["kinds"] == uncalibrated(spec)
    assert doc["expected_s"] > 0 and doc["cached"] is False
    # the same plan again reads the cache: still said, now as instant
    again: list[str] = []
    planner.make_plan(spec, run, cards=["H200"], estimator="analytic", warn=again.append)
    assert "cached: instant" in again[0]


def test_the_default_warning_goes_to_stderr_and_a_calibrated_plan_says_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from moetune.plan import planner

    planner.to_stderr("tracing the real step instead")
    assert capsys.readouterr().err == "warning: tracing the real step instead\n"
    plan = make_plan(tiny("qwen3_next"), cfg(64, True), cards=["H200"], estimator="analytic")
    assert plan.fallback is None and plan.to_json()["fallback"] is None
    assert capsys.readouterr().err == ""


def test_the_expected_trace_time_grows_with_the_tokens_a_python_scan_loops_over() -> None:
    """jamba's Mamba runs transformers' torch `slow_forward` (no mamba-ssm): a Python loop
    over the tokens, so its trace costs ops per token; an attention layer's do not grow."""
    from moetune.plan.tracetime import expected_ops

    jamba, attention = tiny("jamba"), tiny("qwen3_moe")
    assert "mamba" in layer_kinds(jamba)
    grow = expected_ops(jamba, cfg(2048, True)) / expected_ops(jamba, cfg(64, True))
    flat = expected_ops(attention, cfg(2048, True)) / expected_ops(attention, cfg(64, True))
    assert grow > 10 and flat == pytest.approx(1.0)


def test_a_class_that_refuses_checkpointing_is_planned_without_it() -> None:
    """JetMoe's class refuses activation checkpointing: the plan sizes the step train runs
    (checkpointing off) and says why, instead of a step no trainer can run."""
    spec = tiny("jetmoe")
    plan = make_plan(spec, cfg(64, True), cards=["H200"], estimator="analytic")
    assert plan.settings["gradient_checkpointing"] is False
    assert any("JetMoeForCausalLM refuses it" in n for n in plan.notes)
    off = make_plan(spec, cfg(64, False), cards=["H200"], estimator="analytic")
    assert plan.peak_bytes == off.peak_bytes
    small = make_plan(spec, cfg(1 << 20, True), cards=["RTX-4090"], estimator="analytic")
    assert small.recommendations and not any(
        "train.gradient_checkpointing=true" in r.overrides for r in small.recommendations
    )  # never a change the class refuses
    assert not any("refuses" in n for n in off.notes)
