"""The rule engine and every rule's check(): fires on the trap, silent on the fixed config."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from moetune.config import RunConfig
from moetune.lane.providers import site_of
from moetune.lint.registry import (
    RULES,
    Finding,
    Hit,
    LintContext,
    ProbeOutcome,
    lint,
    register_rule,
    rule_table,
)
from moetune.model import load_spec
from moetune.model.spec import Components, ModelSpec
from moetune.units import GiB

QWEN3 = "Qwen/Qwen3-30B-A3B"
QWEN2 = "Qwen/Qwen1.5-MoE-A2.7B"  # qwen2_moe, shared expert
DSV2 = "deepseek-ai/DeepSeek-V2-Lite"  # layer 0 dense, 2 shared experts
GPT_OSS = "openai/gpt-oss-20b"
LLAMA = "meta-llama/Llama-3.1-8B"  # dense
QUIET_VERSIONS = {"peft": "0.21.2", "transformers": "5.24.0"}
REQUIRED = {
    "MOE-LORA-DROPOUT",
    "MOE-4BIT-BNB",
    "PEFT-AUTOMAP-DROPS-MLP",
    "PEFT-QWEN2MOE-UNMAPPED",
    "LORA-ROUTER-TARGETED",
    "LORA-NO-EXPERTS",
    "MLX-DEFAULT-KEYS",
    "MLX-KEYS-NO-MATCH",
    "MLX-TRANSFORMERS-PIN",
    "MLX-NO-BACKEND",
    "MLX-FUSED-KEYS",
    "GGUF-NOT-TRAINABLE",
    "CARD-TOO-SMALL",
    "HUB-XET-ENABLED",
    "VOLUME-TOO-SMALL",
    "WATCHDOG-TOO-SHORT",
    "CI-STEP-TIMEOUT-MISSING",
}


@pytest.fixture(autouse=True)
def _empty_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HUB-XET-ENABLED looks for a cached snapshot; the developer's own cache must not count."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


@cache
def spec(model_id: str) -> ModelSpec:
    return load_spec(model_id)


def ctx(model: str | None = QWEN3, **sections: Any) -> LintContext:
    """A context for `model` with config sections given as dicts; extra LintContext fields
    (peak_bytes, env, versions, …) pass through. env/versions default to empty."""
    fields = {k: sections.pop(k) for k in list(sections) if k not in RunConfig.model_fields}
    cfg = RunConfig.model_validate({"model": {"id": model or "x/y"}, **sections})
    fields.setdefault("env", {})
    fields.setdefault("versions", QUIET_VERSIONS)
    fields.setdefault("site", site_of(cfg.lane.provider))  # as `moetune lint` fills it
    return LintContext(config=cfg, spec=spec(model) if model else None, **fields)


def check(rule_id: str, context: LintContext) -> Finding | None:
    return RULES.get(rule_id).check(context)


# -- the engine ---------------------------------------------------------------------------


def test_every_required_rule_is_registered_with_a_probe() -> None:
    assert set(RULES) >= REQUIRED
    assert all(callable(r.probe_fn) for _, r in RULES.items())


def test_rule_table_lists_every_rule_once() -> None:
    rows = rule_table()
    assert [r["id"] for r in rows] == sorted(RULES)
    assert all(r["severity"] in ("error", "warn", "info") and r["title"] for r in rows)


def test_register_rejects_a_duplicate_id() -> None:
    with pytest.raises(ValueError, match="twice"):
        register_rule("MOE-LORA-DROPOUT", "info", "dup", probe=lambda: ProbeOutcome(True, ""))(
            lambda c: None
        )


def test_lint_sorts_errors_first() -> None:
    findings = lint(
        ctx(
            lora={"dropout": 0.1, "targets": ["attention", "experts", "router"], "engine": "peft"},
            lane={},
        )
    )
    severities = [f.severity for f in findings]
    assert severities == sorted(severities, key=["error", "warn", "info"].index)
    assert {"MOE-LORA-DROPOUT", "LORA-ROUTER-TARGETED"} <= {f.rule_id for f in findings}


def test_default_config_on_the_reference_model_is_clean() -> None:
    assert lint(ctx(env={"HF_HUB_DISABLE_XET": "1"})) == []


def test_context_finds_the_family_and_defaults_env_and_versions() -> None:
    context = LintContext(config=RunConfig(), spec=spec(QWEN3))
    assert context.family is not None and context.family.model_type == "qwen3_moe"
    assert "torch" in context.versions and isinstance(dict(context.env), dict)


def test_finding_to_json_round_trips() -> None:
    f = Finding("X", "warn", "what", "fix", "lora.rank")
    assert Finding(**f.to_json()) == f


def test_hit_severity_overrides_the_rules_default() -> None:
    rule = RULES.get("MOE-LORA-DROPOUT")
    assert rule.severity == "error"
    assert Hit("m", "f", severity="info").severity == "info"


# -- peft / transformers rules ------------------------------------------------------------------


def test_dropout_with_experts_quotes_peft() -> None:
    f = check("MOE-LORA-DROPOUT", ctx(lora={"dropout": 0.1, "engine": "peft"}))
    assert f and f.severity == "error" and f.field == "lora.dropout"
    assert "lora.ParamWrapper does not work with lora_dropout != 0" in f.message


@pytest.mark.parametrize(
    ("model", "targets", "wrapped"),
    [
        (QWEN3, ["attention", "router"], "router"),  # TopKRouter is reached through .weight
        (DSV2, ["attention", "dense"], "dense"),  # explicit: remapped names -> target_parameters
    ],
)
def test_dropout_fires_for_every_param_wrapped_part(
    model: str, targets: list[str], wrapped: str
) -> None:
    f = check("MOE-LORA-DROPOUT", ctx(model, lora={"dropout": 0.1, "targets": targets}))
    assert f and f"while {wrapped} go through" in f.message


@pytest.mark.parametrize(
    "lora",
    [
        {"dropout": 0.0},
        {"dropout": 0.1, "targets": ["attention"]},
        {"dropout": 0.1, "stack": "mlx"},
        {"dropout": 0.1},  # engine auto: split LoRA serves qwen3_moe and applies the dropout
    ],
)
def test_dropout_silent_when_fixed(lora: dict[str, Any]) -> None:
    assert check("MOE-LORA-DROPOUT", ctx(lora=lora)) is None


@pytest.mark.parametrize(
    "train", [{"tuning": "qlora"}, {"quantization": "bnb-4bit"}, {"quantization": "bnb-8bit"}]
)
def test_bnb_on_moe_costs_more_than_bf16(train: dict[str, Any]) -> None:
    f = check("MOE-4BIT-BNB", ctx(train=train))
    assert f and f.severity == "error" and "GiB" in f.message and "fp32" in f.message
    assert "56.9 GiB" in f.message  # Qwen3-30B-A3B in bf16


def test_bnb_is_a_warning_when_quantizing_still_saves_memory() -> None:
    """A (hypothetical) MoE whose experts are a small share: 4-bit still beats bf16."""
    small = replace(spec(QWEN3), components=Components(attention=10 * 10**9, routed_experts=10**9))
    context = ctx(train={"tuning": "qlora"})
    context.spec = small
    f = check("MOE-4BIT-BNB", context)
    assert f and f.severity == "warn" and "9 %" in f.message


def test_bnb_silent_for_bf16_lora_and_for_dense_models() -> None:
    assert check("MOE-4BIT-BNB", ctx(train={"tuning": "lora"})) is None
    assert check("MOE-4BIT-BNB", ctx(LLAMA, train={"tuning": "qlora"})) is None


def test_automap_drops_dense_and_shared_on_deepseek() -> None:
    f = check("PEFT-AUTOMAP-DROPS-MLP", ctx(DSV2, lora={"expert_mapping": "automap"}))
    assert f and f.severity == "error" and f.field == "lora.expert_mapping"
    assert "dense MLP of 1 layer(s)" in f.message and "shared experts of 26" in f.message


@pytest.mark.parametrize(
    ("model", "lora"),
    [
        (DSV2, {"expert_mapping": "explicit"}),
        (DSV2, {"expert_mapping": "automap", "targets": ["attention", "experts"]}),
        (QWEN3, {"expert_mapping": "automap"}),  # no dense layers, no shared experts
    ],
)
def test_automap_drops_silent_when_nothing_is_lost(model: str, lora: dict[str, Any]) -> None:
    assert check("PEFT-AUTOMAP-DROPS-MLP", ctx(model, lora=lora)) is None


def test_qwen2moe_automap_leaves_experts_without_lora() -> None:
    context = ctx(QWEN2, lora={"expert_mapping": "automap"})
    f = check("PEFT-QWEN2MOE-UNMAPPED", context)
    assert f and f.severity == "error" and "60 routed experts in 24 layers" in f.message
    assert check("LORA-NO-EXPERTS", context) is None  # one finding per cause


def test_qwen2moe_explicit_is_fine() -> None:
    assert check("PEFT-QWEN2MOE-UNMAPPED", ctx(QWEN2)) is None


def test_router_in_targets_warns_unless_trained_on_purpose() -> None:
    targets = ["attention", "experts", "router"]
    f = check("LORA-ROUTER-TARGETED", ctx(lora={"targets": targets}))
    assert f and f.severity == "warn" and f.field == "lora.targets"
    trained = ctx(lora={"targets": targets, "train_router": True})
    assert check("LORA-ROUTER-TARGETED", trained) is None
    assert check("LORA-ROUTER-TARGETED", ctx()) is None


def test_router_in_mlx_keys_warns() -> None:
    keys = ["self_attn.q_proj", "mlp.gate", "mlp.switch_mlp.up_proj"]
    f = check("LORA-ROUTER-TARGETED", ctx(lora={"stack": "mlx", "mlx_keys": keys}))
    assert f and f.field == "lora.mlx_keys"


def test_no_experts_targeted_warns_with_the_share() -> None:
    f = check("LORA-NO-EXPERTS", ctx(lora={"targets": ["attention"]}))
    assert f and f.severity == "warn" and "95 %" in f.message


def test_automap_on_an_unmapped_family_is_an_error() -> None:
    f = check("LORA-NO-EXPERTS", ctx(GPT_OSS, lora={"expert_mapping": "automap"}))
    assert f and f.severity == "error" and "gpt_oss" in f.message


def test_mlx_keys_without_experts_warn() -> None:
    keys = ["self_attn.q_proj", "self_attn.v_proj"]
    f = check("LORA-NO-EXPERTS", ctx(lora={"stack": "mlx", "mlx_keys": keys}))
    assert f and "mlp.switch_mlp.gate_proj" in f.fix


@pytest.mark.parametrize(
    ("model", "lora"),
    [
        (QWEN3, {}),
        (GPT_OSS, {"expert_mapping": "explicit"}),
        (QWEN3, {"expert_mapping": "automap"}),
        (LLAMA, {"targets": ["attention"]}),
    ],
)
def test_no_experts_silent_when_experts_are_reached(model: str, lora: dict[str, Any]) -> None:
    assert check("LORA-NO-EXPERTS", ctx(model, lora=lora)) is None


# -- mlx-lm and GGUF ------------------------------------------------------------------------------


def test_mlx_without_keys_warns_and_suggests_keys() -> None:
    f = check("MLX-DEFAULT-KEYS", ctx(lora={"stack": "mlx"}))
    assert f and f.severity == "warn" and "mlp.switch_mlp.down_proj" in f.fix
    keys = ["self_attn.q_proj", "mlp.switch_mlp.up_proj"]
    assert check("MLX-DEFAULT-KEYS", ctx(lora={"stack": "mlx", "mlx_keys": keys})) is None
    assert check("MLX-DEFAULT-KEYS", ctx()) is None


def test_hf_expert_names_in_mlx_keys_are_flagged() -> None:
    keys = ["self_attn.q_proj", "mlp.experts.0.up_proj"]
    f = check("MLX-KEYS-NO-MATCH", ctx(lora={"stack": "mlx", "mlx_keys": keys}))
    assert f and f.severity == "error" and "mlp.experts.0.up_proj" in f.message
    assert "switch_mlp" in f.message and "mlp.switch_mlp.gate_proj" in f.fix


def test_mlx_keys_that_match_are_silent() -> None:
    keys = ["self_attn.q_proj", "mlp.switch_mlp.gate_proj", "lm_head"]
    assert check("MLX-KEYS-NO-MATCH", ctx(lora={"stack": "mlx", "mlx_keys": keys})) is None


@pytest.mark.parametrize(
    "versions",
    [
        {"mlx-lm": "0.31.1", "transformers": "5.13.0"},
        {"mlx-lm": "0.30.6", "transformers": "4.57.1"},
    ],
)
def test_known_bad_mlx_pins(versions: dict[str, str]) -> None:
    f = check("MLX-TRANSFORMERS-PIN", ctx(lora={"stack": "mlx"}, versions=versions))
    assert f and f.severity == "error" and "pip install" in f.fix


@pytest.mark.parametrize(
    ("stack", "versions"),
    [
        ("mlx", {"mlx-lm": "0.31.1", "transformers": "5.24.0"}),
        ("mlx", {"mlx-lm": "0.30.5", "transformers": "4.57.1"}),
        ("mlx", {"transformers": "5.13.0"}),  # mlx-lm absent
        ("peft", {"mlx-lm": "0.31.1", "transformers": "5.13.0"}),
    ],
)
def test_good_mlx_pins_are_silent(stack: str, versions: dict[str, str]) -> None:
    assert check("MLX-TRANSFORMERS-PIN", ctx(lora={"stack": stack}, versions=versions)) is None


@pytest.mark.parametrize(
    "model", [{"id": "unsloth/Qwen3-30B-A3B-GGUF/Q4_K_M.gguf"}, {"id": "x/y", "format": "gguf"}]
)
def test_gguf_base_is_an_error(model: dict[str, str]) -> None:
    context = LintContext(config=RunConfig.model_validate({"model": model}), env={})
    f = check("GGUF-NOT-TRAINABLE", context)
    assert f and f.severity == "error" and "convert_lora_to_gguf" in f.fix


def test_hf_base_is_not_gguf() -> None:
    assert check("GGUF-NOT-TRAINABLE", ctx()) is None


# -- the machine and the walls ----------------------------------------------------------------


def test_card_too_small_names_the_numbers() -> None:
    over = ctx(peak_bytes=int(90 * GiB), card_usable_bytes=int(79.2 * GiB), card_id="H100-80GB")
    f = check("CARD-TOO-SMALL", over)
    assert f and f.severity == "error"
    assert "90.0 GiB" in f.message and "79.2 GiB" in f.message and "H100-80GB" in f.message


def test_card_large_enough_or_unplanned_is_silent() -> None:
    fits = ctx(peak_bytes=int(70 * GiB), card_usable_bytes=int(79.2 * GiB))
    assert check("CARD-TOO-SMALL", fits) is None
    assert check("CARD-TOO-SMALL", ctx(peak_bytes=int(90 * GiB))) is None


def test_xet_on_a_pod_warns_and_points_at_lane_env() -> None:
    f = check("HUB-XET-ENABLED", ctx(lane={"provider": "runpod"}))
    assert f and f.severity == "warn" and f.field == "lane.env" and "61.1 GB" in f.message


def test_xet_local_is_info_and_reads_the_process_env() -> None:
    f = check("HUB-XET-ENABLED", ctx())
    assert f and f.severity == "info"
    assert check("HUB-XET-ENABLED", ctx(env={"HF_HUB_DISABLE_XET": "1"})) is None


def test_xet_disabled_in_lane_env_or_local_model_is_silent(tmp_path: Path) -> None:
    lane = {"provider": "runpod", "env": {"HF_HUB_DISABLE_XET": "1"}}
    assert check("HUB-XET-ENABLED", ctx(lane=lane)) is None
    local = ctx()
    local.config.model.id = str(tmp_path)
    assert check("HUB-XET-ENABLED", local) is None


def test_xet_local_silent_when_the_snapshot_is_cached(tmp_path: Path) -> None:
    assert check("HUB-XET-ENABLED", ctx()) is not None
    (tmp_path / "hub" / "models--Qwen--Qwen3-30B-A3B" / "snapshots").mkdir(parents=True)
    assert check("HUB-XET-ENABLED", ctx()) is None
    assert check("HUB-XET-ENABLED", ctx(lane={"provider": "runpod"})) is not None


def test_volume_default_on_runpod_is_too_small_for_30b() -> None:
    f = check("VOLUME-TOO-SMALL", ctx(lane={"provider": "runpod"}))
    assert f and f.severity == "error" and "40 GB (RunPod default)" in f.message
    assert f.fix == "set lane.volume_gb: 200"


def test_volume_sized_or_local_is_silent() -> None:
    assert check("VOLUME-TOO-SMALL", ctx(lane={"provider": "runpod", "volume_gb": 200})) is None
    assert check("VOLUME-TOO-SMALL", ctx()) is None


def test_explicit_small_volume_on_ssh_is_flagged() -> None:
    f = check("VOLUME-TOO-SMALL", ctx(lane={"provider": "ssh", "volume_gb": 100}))
    assert f and "100 GB <" in f.message and "default" not in f.message


def test_default_watchdog_too_short_for_a_long_run() -> None:
    f = check("WATCHDOG-TOO-SHORT", ctx(lane={"provider": "runpod"}, estimated_train_s=8 * 3600))
    assert f and f.severity == "error" and "6.0 h (RunPod default)" in f.message
    assert f.fix == "set lane.watchdog_s: 45900"  # (8 h + 0.5 h eval) x 1.5


def test_watchdog_silent_when_sized_unknown_or_local() -> None:
    lane = {"provider": "runpod", "watchdog_s": 24300}
    assert check("WATCHDOG-TOO-SHORT", ctx(lane=lane, estimated_train_s=4 * 3600)) is None
    assert check("WATCHDOG-TOO-SHORT", ctx(lane={"provider": "runpod"})) is None
    assert check("WATCHDOG-TOO-SHORT", ctx(estimated_train_s=4 * 3600)) is None


@pytest.mark.parametrize("step", [None, 300, 400])
def test_ci_job_timeout_needs_a_shorter_step_timeout(step: int | None) -> None:
    lane = {"ci_job_timeout_minutes": 300, "ci_step_timeout_minutes": step}
    f = check("CI-STEP-TIMEOUT-MISSING", ctx(lane=lane))
    assert f and f.severity == "error" and f.fix.startswith("set lane.ci_step_timeout_minutes: 285")


def test_ci_step_timeout_shorter_than_job_is_fine() -> None:
    lane = {"ci_job_timeout_minutes": 300, "ci_step_timeout_minutes": 285}
    assert check("CI-STEP-TIMEOUT-MISSING", ctx(lane=lane)) is None
    assert check("CI-STEP-TIMEOUT-MISSING", ctx()) is None


def test_no_spec_keeps_spec_rules_silent() -> None:
    """Without a spec (e.g. a GGUF path) only config-level rules can speak."""
    context = ctx(None, lane={"provider": "runpod"}, train={"tuning": "qlora"})
    ids = {f.rule_id for f in lint(context)}
    assert not ids & {"MOE-4BIT-BNB", "VOLUME-TOO-SMALL", "HUB-XET-ENABLED", "LORA-NO-EXPERTS"}


def _tiny_dbrx(**lora: Any) -> LintContext:
    from moetune.model import spec_from_config
    from moetune.model.tiny import tiny_config

    cfg = RunConfig.model_validate({"model": {"id": "x/y"}, "lora": lora})
    dbrx = spec_from_config(tiny_config("dbrx"), "tiny-dbrx")
    return LintContext(config=cfg, spec=dbrx, env={}, versions=QUIET_VERSIONS)


def test_engine_moetune_on_an_undispatched_family_is_an_error() -> None:
    f = check("ENGINE-MOETUNE-UNSERVED", _tiny_dbrx(engine="moetune"))
    assert f and f.severity == "error" and f.field == "lora.engine"
    assert "dbrx" in f.message and "lora.engine: auto or peft" in f.fix
    assert check("ENGINE-MOETUNE-UNSERVED", _tiny_dbrx()) is None  # auto falls back to peft
    assert check("ENGINE-MOETUNE-UNSERVED", ctx(lora={"engine": "moetune"})) is None


def test_checkpointing_a_model_class_that_refuses_it_warns_that_it_is_off() -> None:
    from moetune.model import spec_from_config
    from moetune.model.census import shrunk_config

    jetmoe = spec_from_config(shrunk_config("jetmoe"), "tiny-jetmoe")
    on = RunConfig.model_validate({"model": {"id": "x/y"}})
    f = check("GC-UNSUPPORTED", LintContext(config=on, spec=jetmoe, env={}))
    assert f and f.severity == "warn" and f.field == "train.gradient_checkpointing"
    assert "JetMoeForCausalLM does not support activation checkpointing" in f.message
    assert "checkpointing off" in f.message  # train and plan turn it off themselves
    off = RunConfig.model_validate(
        {"model": {"id": "x/y"}, "train": {"gradient_checkpointing": False}}
    )
    assert check("GC-UNSUPPORTED", LintContext(config=off, spec=jetmoe, env={})) is None
    assert check("GC-UNSUPPORTED", ctx()) is None  # qwen3_moe checkpoints fine


def test_a_model_without_checkpointable_layers_refuses_checkpointing() -> None:
    """diffusion_gemma_text claims support but its encoder layers are no
    GradientCheckpointingLayer: transformers calls it "not compatible", so it counts as refused."""
    from moetune.model import spec_from_config
    from moetune.model.census import shrunk_config
    from moetune.model.derive import checkpointing_refused

    spec = spec_from_config(shrunk_config("diffusion_gemma_text"), "tiny-diffusion-gemma")
    assert checkpointing_refused(spec) == "DiffusionGemmaEncoderTextModelForCausalLM"
    qwen = spec_from_config(shrunk_config("qwen3_moe"), "tiny-qwen3")
    assert checkpointing_refused(qwen) is None


# -- several nodes --------------------------------------------------------------------------


def test_several_nodes_need_an_address_of_node_0() -> None:
    found = check("DIST-MULTINODE-ADDR", ctx(train={"nnodes": 2}))
    assert found and found.severity == "error" and found.field == "train.master_addr"
    assert "train.nnodes=2 without train.master_addr" in found.message
    assert check("DIST-MULTINODE-ADDR", ctx(train={"nnodes": 1})) is None


@pytest.mark.parametrize("addr", ["999.1.1.1", "10.0.0", "1:2:3:zz"])
def test_a_node_0_address_that_is_no_ip_is_an_error(addr: str) -> None:
    found = check("DIST-MULTINODE-ADDR", ctx(train={"nnodes": 2, "master_addr": addr}))
    assert found and found.severity == "error" and "is not an IP address" in found.message
    named = {"nnodes": 2, "master_addr": "node0.cluster"}  # resolved on the node, not here
    assert check("DIST-MULTINODE-ADDR", ctx(train=named)) is None


@pytest.mark.parametrize("addr", ["127.0.0.1", "localhost", "::1"])
def test_a_loopback_node_0_is_wrong_on_a_remote_lane_only(addr: str) -> None:
    train = {"nnodes": 2, "master_addr": addr}
    found = check("DIST-MULTINODE-ADDR", ctx(train=train, lane={"provider": "skypilot"}))
    assert found and "loopback" in found.message and "on SkyPilot" in found.message
    assert check("DIST-MULTINODE-ADDR", ctx(train=train)) is None  # nodes on one machine
    reachable = {"nnodes": 2, "master_addr": "10.0.0.1"}
    assert check("DIST-MULTINODE-ADDR", ctx(train=reachable, lane={"provider": "ssh"})) is None
