"""ModelSpec counts equal a meta-device build of the real transformers model, exactly.

The meta model's parameters are sorted into components here by their names, a rule set
written independently of moetune's structural reading (model.read).
"""

from __future__ import annotations

import re
from collections import Counter
from functools import cache

import pytest
import torch
import transformers

from moetune.errors import ConfigError, UnknownFamilyError
from moetune.model import (
    OVERRIDES,
    ModelSpec,
    build_model,
    catalog_ids,
    get_family,
    load_spec,
    spec_from_config,
)
from moetune.model.spec import COMPONENTS
from moetune.model.tiny import TINY_CONFIGS, tiny_config
from test_catalog_flagships import FLAGSHIPS
from test_plan_published import BUNDLED

# First matching rule wins; every parameter must match one.
_RULES: list[tuple[str, re.Pattern[str]]] = [
    ("lm_head", re.compile(r"^lm_head\.")),
    ("embeddings", re.compile(r"(embed_tokens|\.wte)\.weight$")),
    ("other", re.compile(r"\.mamba\.")),
    ("shared_experts", re.compile(r"\.(shared_experts?|shared_mlp|shared_expert_gate)\.")),
    ("routed_experts", re.compile(r"\.experts\.")),
    ("routers", re.compile(r"\.(gate|router)\.(weight|bias|wg\.weight|layer\.weight)$")),
    ("routers", re.compile(r"e_score_correction_bias$")),
    ("norms", re.compile(r"norm[^.]*\.(weight|bias)$")),
    ("attention", re.compile(r"\.(self_attn|attn)\.")),
    ("dense_mlp", re.compile(r"\.(mlp|feed_forward|ffn)\.")),
]
_LAYER = re.compile(r"\.(?:layers|blocks)\.(\d+)\.")


def classify(name: str) -> str:
    for component, rule in _RULES:
        if rule.search(name):
            return component
    raise AssertionError(f"parameter {name} fits no component rule")


@cache
def _measured(variant: str) -> tuple[dict[str, int], frozenset[int], frozenset[int]]:
    """(params by component, layers with routed experts, layers with attention) of a meta build."""
    spec = spec_from_config(tiny_config(variant), variant)
    model = build_model(spec)
    counts: Counter[str] = Counter()
    moe_layers: set[int] = set()
    attn_layers: set[int] = set()
    for name, param in model.named_parameters():
        component = classify(name)
        counts[component] += param.numel()
        layer = _LAYER.search(name)
        if layer and component == "routed_experts":
            moe_layers.add(int(layer.group(1)))
        if layer and component == "attention":
            attn_layers.add(int(layer.group(1)))
    return {c: counts.get(c, 0) for c in COMPONENTS}, frozenset(moe_layers), frozenset(attn_layers)


VARIANTS = sorted(TINY_CONFIGS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_components_equal_meta_build(variant: str) -> None:
    spec = spec_from_config(tiny_config(variant), variant)
    by_component, _, _ = _measured(variant)
    assert spec.components.as_dict() == by_component
    assert spec.total_params == sum(by_component.values())


@pytest.mark.parametrize("variant", VARIANTS)
def test_layer_placement_equals_meta_build(variant: str) -> None:
    spec = spec_from_config(tiny_config(variant), variant)
    _, moe_layers, attn_layers = _measured(variant)
    assert set(spec.moe_layers) == moe_layers
    assert set(spec.attention_layers) == attn_layers
    assert set(spec.dense_layers) == set(range(spec.num_layers)) - moe_layers


@pytest.mark.parametrize("variant", VARIANTS)
def test_active_params_count_top_k_experts_per_moe_layer(variant: str) -> None:
    spec = spec_from_config(tiny_config(variant), variant)
    by_component, moe_layers, _ = _measured(variant)
    routed = by_component["routed_experts"]
    if not moe_layers:
        assert spec.active_params == spec.total_params
        return
    idle = routed * (spec.num_experts - spec.top_k) // spec.num_experts
    assert spec.active_params == sum(by_component.values()) - idle
    assert spec.active_params < spec.total_params


# overrides exercised on the census' tiny configs instead of a TINY_CONFIGS variant, each by
# the test named (inkling2_text's build takes seconds: not for every parametrised test)
ON_CENSUS_CONFIGS = {
    "inkling2_text": "test_census.py::test_a_linear_whose_adapter_keys_peft_renames_is_left_out",
}


def test_every_override_has_a_tiny_variant() -> None:
    covered = {get_family(cfg["model_type"]).model_type for cfg in TINY_CONFIGS.values()}
    assert covered | set(ON_CENSUS_CONFIGS) == {over.model_type for _, over in OVERRIDES.items()}
    assert not covered & set(ON_CENSUS_CONFIGS)  # a variant made since: drop it from the list


def test_required_overrides_are_registered() -> None:
    required = [
        "qwen2_moe",
        "qwen3_moe",
        "olmoe",
        "mixtral",
        "deepseek_v2",
        "deepseek_v3",
        "gpt_oss",
        "granitemoe",
        "phimoe",
        "glm4_moe",
        "jamba",
        "dbrx",
        "llama4",
        "llama4_text",
        "ernie4_5_moe",
        "hunyuan_v1_moe",
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
    ]
    assert set(required) <= set(OVERRIDES)


# --- specific shapes ------------------------------------------------------------------


def test_dense_model_is_not_moe_but_still_counted() -> None:
    spec = spec_from_config(tiny_config("llama-biases"), "dense")
    assert not spec.is_moe
    assert (spec.num_experts, spec.moe_layers, spec.top_k) == (0, (), 0)
    assert spec.dense_layers == (0, 1, 2)
    assert spec.active_params == spec.total_params == 8256
    assert spec.components.routed_experts == 0
    assert spec.components.dense_mlp == 3 * (3 * 16 * 24 + 2 * 24 + 16)


def test_aliased_spellings_are_read() -> None:
    mixtral = spec_from_config(tiny_config("mixtral-alias-num_experts"))
    assert mixtral.num_experts == 6  # num_experts -> num_local_experts
    qwen3 = spec_from_config(tiny_config("qwen3_moe-tied-local_experts"))
    assert qwen3.num_experts == 4  # num_local_experts (5.24 spelling) -> num_experts
    dbrx = spec_from_config(tiny_config("dbrx"))  # d_model / n_layers / n_heads / ffn_config
    assert (dbrx.hidden_size, dbrx.num_layers, dbrx.num_attention_heads) == (16, 2, 4)
    assert (dbrx.num_kv_heads, dbrx.num_experts, dbrx.top_k) == (2, 4, 2)
    assert dbrx.expert_intermediate_size == 8
    ernie = spec_from_config(tiny_config("ernie4_5_moe-bias-tied"))
    assert (ernie.num_experts, ernie.top_k) == (4, 2)  # moe_num_experts / moe_k


def test_tied_embeddings_have_no_lm_head() -> None:
    assert spec_from_config(tiny_config("qwen3-tied")).components.lm_head == 0
    # ERNIE ties the weight but keeps its lm_head bias (use_bias)
    assert spec_from_config(tiny_config("ernie4_5_moe-bias-tied")).components.lm_head == 64


def test_shared_and_dense_sizes() -> None:
    q2 = spec_from_config(tiny_config("qwen2_moe-shared-dense0"))
    assert (q2.num_shared_experts, q2.shared_intermediate_size, q2.moe_layers) == (1, 12, (1, 2))
    ds = spec_from_config(tiny_config("deepseek_v2-lite-like"))
    assert (ds.num_shared_experts, ds.shared_intermediate_size) == (2, 16)
    assert ds.dense_layers == (0,)
    assert ds.head_dim == 8  # qk_nope + qk_rope, not transformers' rope-only head_dim


def test_llama4_wrapped_config_uses_text_config() -> None:
    spec = spec_from_config(tiny_config("llama4-wrapped"))
    assert spec.model_type == "llama4_text"
    assert spec.hf_config["model_type"] == "llama4_text"
    assert "vision_config" not in spec.hf_config
    assert spec.moe_layers == (0, 2)
    assert spec.num_shared_experts == 1


def test_jamba_attention_only_in_attention_layers() -> None:
    spec = spec_from_config(tiny_config("jamba"))
    assert spec.attention_layers == (0, 2)
    assert spec.moe_layers == (1, 3)
    assert spec.components.other > 0  # the Mamba mixers


def test_hunyuan_rejects_unequal_per_layer_top_k() -> None:
    cfg = tiny_config("hunyuan_v1_moe")
    cfg["moe_topk"] = [2, 1, 2]
    with pytest.raises(ConfigError, match="moe_topk"):
        spec_from_config(cfg, "hy")


def test_invalid_field_is_a_config_error_naming_the_model() -> None:
    cfg = tiny_config("mixtral")
    cfg["num_hidden_layers"] = "three"
    with pytest.raises(ConfigError, match="broken-mixtral"):
        spec_from_config(cfg, "broken-mixtral")


def test_missing_required_field_is_a_config_error() -> None:
    cfg = tiny_config("qwen3_moe-dense0")
    cfg["num_experts_per_tok"] = None
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        spec_from_config(cfg, "q")


def test_unknown_model_type_names_the_installed_transformers() -> None:
    with pytest.raises(UnknownFamilyError) as err:
        spec_from_config({"model_type": "not_a_model", "hidden_size": 8})
    assert "not_a_model" in err.value.cause
    assert transformers.__version__ in err.value.cause
    assert "upgrade transformers" in err.value.fix


def test_unbuildable_config_names_what_transformers_said() -> None:
    bert = {"model_type": "bert", "hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 32,
            "num_attention_heads": 12}  # fmt: skip
    with pytest.raises(ConfigError) as err:  # bert builds as a causal LM, not with 12 heads of 8
        spec_from_config(bert, "b")
    assert "not a multiple of the number of attention heads" in err.value.cause
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"num_hidden_layers": 100_000_000}, "num_hidden_layers=100,000,000; it must be at most"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0; it must be at least 1"),
        ({"hidden_size": -16}, "hidden_size=-16; it must be at least 1"),
        ({"num_experts": 0}, "num_experts=0; it must be at least 1"),
        ({"num_experts_per_tok": 9}, "top-k 9 exceeds the 4 experts"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok=0; it must be at least 1"),
    ],
)
def test_configs_that_cannot_be_real_are_refused_before_a_build(change: dict, said: str) -> None:
    cfg = {**tiny_config("qwen3_moe-dense0"), **change}
    with pytest.raises(ConfigError) as err:
        spec_from_config(cfg, "q")
    assert said in err.value.cause


def test_missing_size_fields_are_named_not_defaulted() -> None:
    cfg = tiny_config("qwen3_moe-dense0")
    del cfg["hidden_size"], cfg["vocab_size"]
    with pytest.raises(ConfigError) as err:
        spec_from_config(cfg, "q")
    assert "does not state hidden_size, vocab_size" in err.value.cause


def test_missing_model_type_is_unknown_family() -> None:
    with pytest.raises(UnknownFamilyError) as err:
        spec_from_config({"hidden_size": 8}, "mystery")
    assert "no model_type" in err.value.cause
    assert "qwen3_moe" in err.value.fix


# --- full-size catalog models ---------------------------------------------------------


def test_qwen3_30b_a3b_exact() -> None:
    spec = load_spec("Qwen/Qwen3-30B-A3B")
    assert spec.total_params == 30_532_122_624
    assert spec.bytes_in(2) == 61_064_245_248
    assert spec.components.as_dict() == {
        "embeddings": 151_936 * 2048,
        "attention": 48 * (2048 * 4096 * 2 + 2048 * 512 * 2),
        "dense_mlp": 0,
        "routed_experts": 48 * 128 * 3 * 2048 * 768,
        "shared_experts": 0,
        "routers": 48 * 128 * 2048,
        "norms": 48 * (2 * 2048 + 2 * 128) + 2048,
        "lm_head": 151_936 * 2048,
        "other": 0,
    }
    assert spec.active_params == 3_353_032_704  # ~3.35 B: 8 of 128 experts per layer
    assert spec.moe_layers == tuple(range(48))
    assert (spec.num_experts, spec.top_k, spec.expert_intermediate_size) == (128, 8, 768)
    model = build_model(spec)
    assert sum(p.numel() for p in model.parameters()) == 30_532_122_624


# Exact totals (== meta build, see below) and the published figure they round to.
EXPECTED = {
    "Qwen/Qwen3-30B-A3B": (30_532_122_624, 30.5e9),
    "Qwen/Qwen3-235B-A22B": (235_093_634_560, 235.1e9),
    "Qwen/Qwen1.5-MoE-A2.7B": (14_315_784_192, 14.3e9),
    "allenai/OLMoE-1B-7B-0924": (6_919_161_856, 6.9e9),
    "deepseek-ai/DeepSeek-V2-Lite": (15_706_484_224, 15.7e9),
    "deepseek-ai/DeepSeek-V3": (671_026_404_352, 671e9),  # MTP layer not built by transformers
    "mistralai/Mixtral-8x7B-v0.1": (46_702_792_704, 46.7e9),
    "openai/gpt-oss-20b": (20_914_757_184, 20.9e9),
    "openai/gpt-oss-120b": (116_829_156_672, 116.8e9),
    "meta-llama/Llama-3.1-8B": (8_030_261_248, 8.03e9),
}


def test_catalog_has_the_expected_models() -> None:
    # the late-2026 flagships are checked in test_catalog_flagships (their families land later)
    # the published quantised checkpoints are checked against their files in test_plan_published
    assert set(EXPECTED) | set(FLAGSHIPS) | BUNDLED == set(catalog_ids())


@pytest.mark.parametrize("model_id", sorted(EXPECTED))
def test_catalog_total_matches_published(model_id: str) -> None:
    exact, published = EXPECTED[model_id]
    spec = load_spec(model_id)
    assert spec.total_params == exact
    assert abs(spec.total_params - published) / published < 0.005


@pytest.mark.parametrize("model_id", sorted(EXPECTED))
def test_catalog_spec_equals_meta_build(model_id: str) -> None:
    spec: ModelSpec = load_spec(model_id)
    model = build_model(spec)  # meta: < 1 s even for 671B
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == spec.total_params
    assert {p.dtype for p in params} <= {torch.bfloat16, torch.float32}
    assert all(p.device.type == "meta" for p in params)


def test_active_params_of_catalog_models() -> None:
    # A<n>B names: 3.3B, 22B, 2.7B active; Mixtral 12.9B; DeepSeek-V3 37B (embeddings included)
    active = {m: load_spec(m).active_params / 1e9 for m in EXPECTED}
    assert active["Qwen/Qwen3-30B-A3B"] == pytest.approx(3.35, abs=0.01)
    assert active["Qwen/Qwen3-235B-A22B"] == pytest.approx(22.19, abs=0.01)
    assert active["Qwen/Qwen1.5-MoE-A2.7B"] == pytest.approx(2.69, abs=0.01)
    assert active["mistralai/Mixtral-8x7B-v0.1"] == pytest.approx(12.88, abs=0.01)
    assert active["deepseek-ai/DeepSeek-V3"] == pytest.approx(37.55, abs=0.01)
    assert active["meta-llama/Llama-3.1-8B"] == pytest.approx(8.03, abs=0.01)


@pytest.mark.parametrize("variant", ["qwen3_moe-dense0", "mixtral"])
def test_a_missing_experts_count_is_named_not_defaulted(variant: str) -> None:
    cfg = tiny_config(variant)
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        cfg.pop(name, None)
    with pytest.raises(ConfigError) as err:
        spec_from_config(cfg, "q")
    assert "does not state" in err.value.cause and "(the experts count)" in err.value.cause
