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
from moetune.plan.profiles.registry import (
    NEMOTRON_H,
    PROFILES,
    ActivationProfile,
    layer_kinds,
    uncalibrated,
)
from moetune.plan.recommend import refuses_checkpointing
from moetune.plan.trace.cache import cached_trace

NEMOTRON_BEHIND = ["full_attention", "linear_attention", "moe", "mlp"]  # Mamba after attention
NEMOTRON_WIDE = {"mamba_num_heads": 8, "chunk_size": 16}
NEMOTRON_HELD_OUT = {"ssm_state_size": 32, "n_groups": 2, "mamba_head_dim": 8}  # not in the fit
# Gemma-4-26B-A4B's layout at tiny width: full-attention layers with k = v and one key/value
# head of twice the sliding layers' head dim, no per-layer inputs
GEMMA4_26B_LAYOUT = {
    "hidden_size_per_layer_input": 0,
    "attention_k_eq_v": True,
    "per_layer_config": {3: {"head_dim": 32, "num_key_value_heads": 1}},
}
# (model_type, the mixer kind its layers calibrate); analytic vs trace: the bytes the layers
# keep for backward (gc off − gc on; a class that refuses gc: seq 128 − seq 64) within 5 %,
# the peak within 2 %
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
    ("granitemoehybrid", "mamba", {"mamba_d_state": 32}),  # N 32 at head dim 32: −1 % kept
    # Mamba2 as granitemoehybrid's (other field names) behind attention; relu² MLP layers
    ("nemotron_h", "mamba", {}),  # Mamba at layer 0: keeps nothing without checkpointing
    ("nemotron_h", "mamba", {"layers_block_type": NEMOTRON_BEHIND}),
    ("nemotron_h", "mamba", {"layers_block_type": NEMOTRON_BEHIND, **NEMOTRON_WIDE}),
    ("nemotron_h", "mamba", {"layers_block_type": NEMOTRON_BEHIND, **NEMOTRON_HELD_OUT}),
    # Mamba1's recurrent torch scan: its trace loops over the tokens (~90 s a shape)
    pytest.param("jamba", "mamba", {}, marks=pytest.mark.slow),
    pytest.param("jamba", "mamba", {"mamba_d_state": 32}, marks=pytest.mark.slow),
    pytest.param(  # held out of the fit
        "jamba", "mamba", {"hidden_size": 96, "mamba_d_state": 8}, marks=pytest.mark.slow
    ),
    ("kimi_linear", "linear_attention", {}),  # KDA's torch chunked kernel, beside MLA
    ("minimax", "linear_attention", {}),  # lightning attention beside windowed SDPA
    ("lara_mini", "linear_attention", {}),  # gated DeltaNet; sliding layers: masked SDPA
    ("hy_v4", "mla", {}),  # eager MLA with sinks + DSA indexer, hyper-connections (N = 4)
    ("hy_v4", "mla", {"hc_mult": 2}),  # held out of the fit: kept within 0.1 %
    pytest.param("hy_v4", "mla", {"hidden_size": 128}, marks=pytest.mark.slow),  # held out
    ("hy_v4_vl_text", "mla", {}),
    # two MLA sublayers per layer (a ModuleList) and identity experts beside 4 real ones
    ("longcat_flash", "mla", {"zero_expert_num": 4}),
    ("longcat_flash", "mla", {"zero_expert_num": 8, "hidden_size": 128}),  # held out
    # DSA + an output gate and gated RMSNorms (the post-attention one in MoE layers only)
    ("axk2", "mla", {}),  # equal q/k and v head dims: the fused SDPA kernel
    ("axk2", "mla", {"v_head_dim": 8}),  # the math kernel, s² fp32
    ("axk2", "mla", {"gated_norm_rank": 32, "hidden_size": 128}),  # held out of the fit
    # per layer type: masked SDPA on sliding windows, causal on full attention (own head dim)
    ("gemma4_text", "attention", {}),  # the census shape: per-layer inputs of width 256
    ("gemma4_text", "attention", GEMMA4_26B_LAYOUT),  # k = v, 2 kv heads of twice the dim
    # held out of the fit: 8 heads, a 64-token window, no per-layer inputs
    ("gemma4_text", "attention", {**GEMMA4_26B_LAYOUT, "num_attention_heads": 8,
                                  "sliding_window": 64}),
    ("inkling_text", "conv", {}),  # relative-bias math SDPA between fp32 short convs
    ("inkling_text", "conv", {"num_attention_heads": 8, "swa_num_attention_heads": 8}),
    ("inkling_text", "conv", {"rel_extent": 256}),  # held out of the fit
    ("inkling2_text", "conv", {}),  # eager sink attention, dynamic k/v convs, block residuals
    ("inkling2_text", "conv", {"n_layers_per_attn_res_block": 2}),  # more residual states
    ("inkling2_text", "conv", {"hidden_size": 128}),  # held out of the fit
    ("inkling2_loop_text", "conv", {}),  # no layer in its loop range: Inkling2's layers
    ("inkling2_loop_text", "conv", {"num_attention_heads": 8, "swa_num_attention_heads": 8}),
    ("jetmoe", "attention", {}),  # a mixture of attention experts (routed q / o stacks)
    ("jetmoe", "attention", {"kv_channels": 64}),
    ("jetmoe", "attention", {"num_experts_per_tok": 3}),  # held out of the fit
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
]  # fmt: skip
KEPT_TOLERANCE, PEAK_TOLERANCE = 0.05, 0.02


@pytest.fixture
def no_mamba_term(monkeypatch: pytest.MonkeyPatch) -> None:
    """nemotron_h as it planned before its Mamba2 term: a kind with no calibrated term (a
    real family, so its fallback trace is the real one)."""
    mixers = {**NEMOTRON_H.mixers, "mamba": None}
    monkeypatch.setitem(PROFILES, "nemotron_h", dataclasses.replace(NEMOTRON_H, mixers=mixers))


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
    # a class that refuses checkpointing (jetmoe) traces without it: the layers' keep-set
    # is then what 64 more tokens add
    on, off = cfg(128, True), cfg(128, False)
    if refuses_checkpointing(spec):
        on = cfg(64, False)
    est_on, est_off = analytic(spec, on).peak_bytes, analytic(spec, off).peak_bytes
    trace_on, trace_off = cached_trace(spec, on).peak_bytes, cached_trace(spec, off).peak_bytes
    # without checkpointing every layer keeps its saved set: the mixer term dominates this
    assert est_off - est_on == pytest.approx(trace_off - trace_on, rel=KEPT_TOLERANCE)
    assert est_off == pytest.approx(trace_off, rel=PEAK_TOLERANCE)


def test_a_mamba_layer_before_the_first_adapter_keeps_nothing_without_checkpointing() -> None:
    """Without checkpointing the embeddings need no gradient, so a Mamba layer (no adapters)
    before the first adapted layer saves nothing: sizing it put jamba's kept bytes a third
    high (4 Mamba layers sized, 3 keep), and granitemoehybrid's Mamba2 term, fitted with it,
    came out 25 % low per layer. With checkpointing every layer recomputes with a gradient."""
    from moetune.plan.analytic import _grad_free
    from moetune.plan.layout import adapter_layout
    from moetune.plan.step import Step

    for model_type, free in (("jamba", {0}), ("nemotron_h", {0, 1}), ("qwen3_next", set())):
        spec = tiny(model_type)
        layout = adapter_layout(spec, cfg(128, False).lora)
        assert _grad_free(spec, Step(128, gradient_checkpointing=False), layout) == free
        assert _grad_free(spec, Step(128), layout) == set()
    # nemotron_h's relu² MLP layers are a kind of their own, with a term
    assert layer_kinds(tiny("nemotron_h")) == ("mamba", "none", "attention", "mlp")


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
    from moetune.plan.profiles import hybrid

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


def test_an_uncalibrated_mixer_kind_plans_with_the_trace_and_says_so(no_mamba_term: None) -> None:
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
    monkeypatch: pytest.MonkeyPatch, no_mamba_term: None
) -> None:
    from moetune.errors import TraceError
    from moetune.plan.trace import cache as tracecache

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


def test_a_quantized_step_cannot_trace_and_says_what_the_analytic_leaves_out(
    no_mamba_term: None,
) -> None:
    spec = tiny("nemotron_h")
    plan = make_plan(spec, cfg(64, True, tuning="qlora"), cards=["H200"], estimator="analytic")
    assert plan.estimator == "analytic"
    assert "cannot be traced" in plan.notes[0] and "mamba" in plan.notes[0]


def test_an_unknown_kind_in_a_known_family_is_uncalibrated() -> None:
    spec = tiny("minimax_m2")
    odd = dataclasses.replace(spec, mixers=("attention", "retention", "attention", "attention"))
    assert uncalibrated(odd) == ["retention"]
    assert uncalibrated(dataclasses.replace(spec, mixers=())) == []  # every layer: attention


def test_an_inkling2_loop_build_whose_layers_loop_keeps_the_trace() -> None:
    """Loop layers run several passes with message residuals no term sizes: such a build is
    uncalibrated (the census' tiny config has none in range and plans analytically)."""
    looping = {"loop_layer_index_start": 2, "loop_layer_index_end": 4}
    spec = tiny("inkling2_loop_text", n_layers_per_attn_res_block=2, **looping)
    assert uncalibrated(spec) == ["conv"] and uncalibrated(tiny("inkling2_loop_text")) == []
    assert uncalibrated(tiny("inkling2_text", n_layers_per_attn_res_block=2)) == []


def test_an_indexer_family_with_more_than_dsa_keeps_the_trace() -> None:
    """axk2 (gated norms, an output gate) and hy_v4 (hyper-connections) are MLA + an indexer
    too, but keep more than the DSA term sizes (19 % / 57 %): each has its own terms on top."""
    assert all(uncalibrated(tiny(t)) == [] for t in ("glm_moe_dsa", "axk2", "hy_v4"))


def test_hyper_connections_widen_what_each_layer_keeps_and_checkpoints() -> None:
    """hy_v4's residual is hc_mult streams: the DSA term alone sized its layers 57 % low; the
    streams' term grows with their number, and a checkpoint is streams × hidden wide."""
    from moetune.plan.profiles.registry import profile_for

    prof = profile_for("hy_v4")
    four, two = tiny("hy_v4"), tiny("hy_v4", hc_mult=2)
    assert prof.streams(four) == 4 and prof.streams(two) == 2
    # two connections per layer: 6·N·H + 4·H + 24·N + 4 each, at H = 64
    assert prof.residual(four) == 2 * (6 * 4 * 64 + 4 * 64 + 24 * 4 + 4) == 3784
    assert prof.residual(four) - prof.residual(two) == 2 * (6 * 2 * 64 + 24 * 2)
    run = cfg(128, True)
    assert analytic(four, run).peak_bytes > analytic(two, run).peak_bytes


def test_a_fallback_to_the_trace_warns_before_it_starts_with_the_expected_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, no_mamba_term: None
) -> None:
    """jamba's analytic once fell back to a 432 s trace without a word: the warning comes
    first (before the trace runs), names the kinds and the expected time, and the JSON
    holds the same."""
    from moetune.plan import planner
    from moetune.plan.trace import cache as tracecache

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
    from moetune.plan.trace.duration import expected_ops

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


def test_an_mla_pair_in_a_module_list_is_named_and_identity_experts_keep_less() -> None:
    """longcat_flash holds two MLA sublayers per layer in a ModuleList: once read as a
    "modulelist" mixer (traced); an identity expert's slot keeps its input and the weighted
    product (4·H), a real one's also the gate/up and down activations (6·H + 8·I)."""
    from moetune.plan.profiles.mla import zero_expert_routed

    few, many = tiny("longcat_flash", zero_expert_num=4), tiny("longcat_flash")
    assert layer_kinds(many) == ("mla",) * 4 and uncalibrated(many) == []
    h, inter, k = 64, 32, 2
    assert zero_expert_routed(few, True) == k * (0.5 * (6 * h + 8 * inter) + 0.5 * 4 * h + 20)
    assert zero_expert_routed(many, True) < zero_expert_routed(few, True)
    assert zero_expert_routed(few, False) < zero_expert_routed(few, True)


def test_gemma4_plans_by_layer_type_through_its_text_model() -> None:
    """Gemma 4's sliding and full-attention layers get a term each (the released layout's
    full layers: k = v, 2 kv heads of 512, repeated to every head by SDPA); the multimodal
    checkpoint plans its text model with the same terms; shared k/v layers stay traced."""
    from moetune.model import load_spec
    from moetune.plan.profiles.registry import layer_terms

    released = load_spec("google/gemma-4-26B-A4B-it")
    assert uncalibrated(released) == []
    sliding, full = layer_terms(released)[0], layer_terms(released)[5]
    # q/k/v norms + masked SDPA: 16 heads × 256 (k, v repeated from 8) + the window's mask
    assert (sliding.per_token(released), sliding.pairs(released)) == (65_856, 2)
    # full: 16 q heads + 2 kv heads × 512, k and v repeated to 16 heads (dim > 256), no mask
    assert (full.per_token(released), full.pairs(released)) == (106_720, 0)
    text, multimodal = tiny("gemma4_text"), spec_from_config(shrunk_config("gemma4"), "gemma4")
    assert multimodal.model_type == "gemma4_text" and uncalibrated(multimodal) == []
    assert layer_terms(multimodal) == layer_terms(text)
    plan = make_plan(multimodal, cfg(64, True), cards=["H200"], estimator="analytic")
    assert plan.estimator == "analytic"
    types = ["sliding_attention", "full_attention"] * 2
    shared = tiny("gemma4_text", layer_types=types, num_kv_shared_layers=2)
    assert uncalibrated(shared) == ["attention"]


@pytest.mark.slow
def test_gemma4_at_the_released_heads_and_a_long_sequence() -> None:
    """Gemma-4-26B-A4B's heads (16 × 256 on windows of 1024; full layers k = v, 2 kv heads ×
    512, repeated by SDPA) at tiny width, seq 1024: the q norm's fp32 backward on the full
    layer is the checkpointed peak (`q_norm_backward`, fitted at seq 2048)."""
    layout = {
        "hidden_size_per_layer_input": 0, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "sliding_window": 1024, "attention_k_eq_v": True,
        "num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "per_layer_config": {5: {"head_dim": 512, "num_key_value_heads": 2}},
    }  # fmt: skip
    spec = tiny("gemma4_text", **layout)
    for gc in (True, False):
        run = cfg(1024, gc)
        est, traced = analytic(spec, run).peak_bytes, cached_trace(spec, run).peak_bytes
        assert est == pytest.approx(traced, rel=PEAK_TOLERANCE)
