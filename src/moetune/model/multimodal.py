"""Multimodal checkpoints (`…ForConditionalGeneration`) in their own layout.

A multimodal MoE checkpoint holds its language model beside vision / audio towers, under
the names transformers' multimodal class gives them (`model.language_model.layers.N…`,
`language_model.model.layers.N…`, `thinker.model.language_model…`). moetune trains it as
that class, so the adapter's keys and a merged export are the checkpoint's own, and aims
LoRA at the language model's decoder layers alone (docs/knowledge.md §13):

- `text_config_of`: the language model's config (`text_config`, or the `text_config` of a
  sub-config such as Qwen3-Omni's `thinker_config`);
- `multimodal_class`: transformers' class for the whole checkpoint (`derive.checkpoint_class`
  picks it, or the causal-LM class for a text checkpoint);
- `language_layers`: where the language model's decoder layers sit in a build of it.
"""

from __future__ import annotations

from typing import Any

from moetune.model.read import find_layers


def _sub_configs(config: Any) -> dict[str, Any]:
    return dict(getattr(type(config), "sub_configs", None) or {})


def text_path(config: Any) -> tuple[str, ...]:
    """The attribute path from `config` to its language model's config: () for a text
    config, ("text_config",), or through the first sub-config that has one ("thinker_config",
    "text_config")."""
    subs = _sub_configs(config)
    if "text_config" in subs and getattr(config, "text_config", None) is not None:
        return ("text_config",)
    for name in subs:
        inner = getattr(config, name, None)
        if inner is not None and "text_config" in _sub_configs(inner):
            return (name, *text_path(inner))
    return ()


def text_config_of(config: Any) -> Any:
    """The language model's config inside `config` (itself for a text model)."""
    for name in text_path(config):
        config = getattr(config, name)
    return config


def text_keys(values: dict[str, Any]) -> tuple[str, ...]:
    """`text_path` of a config.json dict: the keys down to its language model's dict."""
    if isinstance(values.get("text_config"), dict):
        return ("text_config",)
    for key, value in values.items():
        if key.endswith("_config") and isinstance(value, dict) and "text_config" in value:
            return (key, *text_keys(value))
    return ()


def text_dict(values: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config.json dict (itself for a text model)."""
    for key in text_keys(values):
        values = values[key]
    return values


def multimodal_class(config: Any) -> Any:
    """transformers' multimodal class for a config holding a language model, else None."""
    if not text_path(config):
        return None
    # lazy: heavy to import (transformers)
    from transformers.models.auto import modeling_auto as auto

    for mapping in (
        auto.MODEL_FOR_MULTIMODAL_LM_MAPPING,
        auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    ):
        if type(config) in mapping:
            return mapping[type(config)]
    return None


def language_layers(model: Any, text_model_type: str, num_layers: int) -> str | None:
    """The path of the language model's decoder layers in a multimodal build: under the
    outermost module whose config is the language model's (towers have their own), or None."""
    holders = [
        path
        for path, module in model.named_modules()
        if path and getattr(getattr(module, "config", None), "model_type", None) == text_model_type
    ]
    if not holders:
        return None
    outer = min(holders, key=len)
    inner, _ = find_layers(model.get_submodule(outer), num_layers)
    return f"{outer}.{inner}"
