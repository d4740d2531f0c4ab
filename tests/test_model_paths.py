"""Module paths, expert layouts and peft auto-mapping per family, probed on real builds.

These are facts about the installed transformers/peft: when a release moves a module or
changes a mapping, these tests fail and name the family.
"""

from __future__ import annotations

import re
import warnings
from functools import cache

import pytest
import torch
from torch import nn

from moetune.model import ModelSpec, build_model, get_family, spec_from_config, to_hf_config
from moetune.model.tiny import TINY_CONFIGS, tiny_config

VARIANTS = sorted(TINY_CONFIGS)
# Linear layers no recipe targets: Mamba mixers and the 1-wide shared-expert gate.
_UNTARGETED = re.compile(r"^(mamba\.|mlp\.shared_expert_gate$)")


@cache
def _built(variant: str) -> tuple[ModelSpec, nn.Module]:
    spec = spec_from_config(tiny_config(variant), variant)
    return spec, build_model(spec)


def _layer(model: nn.Module, prefix: str, index: int) -> nn.Module:
    return model.get_submodule(f"{prefix}.{index}")


def _linears(layer: nn.Module) -> set[str]:
    return {name for name, mod in layer.named_modules() if isinstance(mod, nn.Linear)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_paths_are_the_attention_linears(variant: str) -> None:
    spec, model = _built(variant)
    family = get_family(spec.model_type)
    paths = family.paths_of(spec)
    for i in spec.attention_layers:
        linears = _linears(_layer(model, family.layers_prefix, i))
        attention = {n.rsplit(".", 1)[-1] for n in linears if "attn" in n}
        assert attention == set(paths.attention), f"layer {i}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_expert_router_shared_and_dense_paths_exist(variant: str) -> None:
    spec, model = _built(variant)
    family = get_family(spec.model_type)
    paths = family.paths_of(spec)
    for i in spec.moe_layers:
        layer = _layer(model, family.layers_prefix, i)
        params = dict(layer.named_parameters())
        assert all(p in params for p in paths.expert_params), f"layer {i}"
        assert all(layer.get_submodule(r) is not None for r in paths.router)
        if spec.num_shared_experts:
            assert set(paths.shared) <= _linears(layer), f"layer {i}"
    for i in spec.dense_layers:
        assert set(paths.dense_mlp) <= _linears(_layer(model, family.layers_prefix, i))
    if spec.is_moe:
        assert paths.expert_params and paths.router
    if spec.dense_layers:
        assert paths.dense_mlp


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_linear_is_covered_by_some_path(variant: str) -> None:
    spec, model = _built(variant)
    family = get_family(spec.model_type)
    paths = family.paths_of(spec)
    known = {*paths.dense_mlp, *paths.shared, *paths.router}
    for i in range(spec.num_layers):
        for name in _linears(_layer(model, family.layers_prefix, i)):
            leaf = name.rsplit(".", 1)[-1]
            covered = name in known or ("attn" in name and leaf in paths.attention)
            assert covered or _UNTARGETED.match(name), f"layer {i}: {name} has no path"


def _moe_variants() -> list[str]:
    return [v for v in VARIANTS if spec_from_config(tiny_config(v)).is_moe]


@pytest.mark.parametrize("variant", _moe_variants())
def test_experts_layout_matches_transformers(variant: str) -> None:
    spec, model = _built(variant)
    family = get_family(spec.model_type)
    layout = family.layout
    first = family.paths_of(spec).expert_params[0]
    experts_path = f"{family.layers_prefix}.{spec.moe_layers[0]}.{first.rsplit('.', 1)[0]}"
    experts = model.get_submodule(experts_path)
    flags = [getattr(experts, a, None) for a in ("is_concatenated", "is_transposed", "has_bias")]
    if layout.experts_interface:
        assert flags == [layout.is_concatenated, layout.is_transposed, layout.has_bias]
    else:
        assert flags == [None, None, None]
    e, h, i = spec.num_experts, spec.hidden_size, spec.expert_intermediate_size
    gate_up = model.get_parameter(f"{family.layers_prefix}.{spec.moe_layers[0]}.{first}")
    if layout.flat_2d:
        expected: tuple[int, ...] = (e * i, h)
    else:
        expected = (e, h, 2 * i) if layout.is_transposed else (e, 2 * i, h)
    assert tuple(gate_up.shape) == expected
    assert hasattr(experts, "gate_up_proj_bias") == layout.has_bias


def _one_variant_per_moe_family() -> list[str]:
    seen: dict[str, str] = {}
    for v in _moe_variants():
        seen.setdefault(get_family(TINY_CONFIGS[v]["model_type"]).model_type, v)
    return sorted(seen.values())


def _lora_reaches_experts(variant: str, target_modules: list[str]) -> bool:
    """Apply peft LoRA by module names; True when the fused experts got adapters."""
    from peft import LoraConfig, get_peft_model

    spec = spec_from_config(tiny_config(variant), variant)
    model = build_model(spec, device="cpu", dtype=torch.float32)
    config = LoraConfig(r=2, target_modules=target_modules, lora_dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            peft_model = get_peft_model(model, config)
        except ValueError as exc:  # NoMatchingPeftModuleError: nothing matched at all
            assert "not found in the base model" in str(exc)
            return False
    names = [n for n, _ in peft_model.named_parameters() if "lora_A" in n]
    return any(".experts." in n and "shared" not in n for n in names)


@pytest.mark.parametrize("variant", _one_variant_per_moe_family())
def test_peft_automap_flag_matches_installed_peft(variant: str) -> None:
    family = get_family(TINY_CONFIGS[variant]["model_type"])
    reached = _lora_reaches_experts(variant, ["gate_proj", "up_proj", "down_proj"])
    assert reached == family.peft_automap
    if family.peft_automap_names:
        assert _lora_reaches_experts(variant, list(family.peft_automap_names))


def test_qwen2_moe_names_reach_only_the_shared_expert() -> None:
    """docs/knowledge.md §3: qwen2_moe is not auto-mapped; only shared_expert gets LoRA."""
    from peft import LoraConfig, get_peft_model

    spec = spec_from_config(tiny_config("qwen2_moe-shared-dense0"))
    model = build_model(spec, device="cpu", dtype=torch.float32)
    config = LoraConfig(r=2, target_modules=["gate_proj", "up_proj", "down_proj"])
    adapted = {n for n, _ in get_peft_model(model, config).named_parameters() if "lora_A" in n}
    moe_layer = {n for n in adapted if ".layers.1." in n}
    assert moe_layer and all(".shared_expert." in n for n in moe_layer)


def test_mlx_paths_for_families_mlx_supports() -> None:
    for variant in VARIANTS:
        spec = spec_from_config(tiny_config(variant))
        family = get_family(spec.model_type)
        if not family.mlx_supported:
            continue
        paths = family.paths_of(spec)
        assert paths.mlx_attention, variant
        assert paths.mlx_experts if spec.is_moe else paths.mlx_dense, variant


def test_deepseek_paths_follow_q_lora_rank() -> None:
    lite = spec_from_config(tiny_config("deepseek_v2-lite-like"))
    v3 = spec_from_config(tiny_config("deepseek_v3"))
    family = get_family("deepseek_v3")
    assert "q_proj" in family.paths_of(lite).attention
    assert "q_a_proj" not in family.paths_of(lite).attention
    assert {"q_a_proj", "q_b_proj"} <= set(family.paths_of(v3).attention)
    # mlx-lm's keys follow the build: only the projections the model has
    assert "self_attn.q_proj" in family.paths_of(lite).mlx_attention
    assert "self_attn.q_a_proj" not in family.paths_of(lite).mlx_attention
    assert "self_attn.q_proj" not in family.paths_of(v3).mlx_attention
    # transformers' default q_lora_rank (1536) applies when config.json omits it
    cfg = tiny_config("deepseek_v3")
    del cfg["q_lora_rank"]
    assert "q_a_proj" in family.paths_of(spec_from_config(cfg)).attention


def test_to_hf_config_classes() -> None:
    expected = {
        "llama4-wrapped": "Llama4TextConfig",
        "dbrx": "DbrxConfig",
        "qwen3_moe-dense0": "Qwen3MoeConfig",
        "gpt_oss": "GptOssConfig",
    }
    for variant, cls in expected.items():
        assert type(to_hf_config(spec_from_config(tiny_config(variant)))).__name__ == cls


def test_build_model_dtype_and_device() -> None:
    spec = spec_from_config(tiny_config("olmoe"))
    model = build_model(spec)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"meta"}
    cpu = build_model(spec, device="cpu", dtype="float32")
    assert {p.dtype for p in cpu.parameters()} == {torch.float32}
    logits = cpu(torch.tensor([[1, 2, 3]])).logits
    assert tuple(logits.shape) == (1, 3, 64)
