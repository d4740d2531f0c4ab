"""What a model is, from its config.json alone: family, MoE layout, exact parameter counts.

spec = load_spec("Qwen/Qwen3-30B-A3B")     # bundled, local dir/file, or hub config.json
spec.total_params, spec.active_params, spec.components
model = build_model(spec)                  # weightless (meta) transformers model
"""

from __future__ import annotations

from typing import Any

from moetune.model import fixes as _fixes  # noqa: F401  (registers the fixes)
from moetune.model.build import build_model, to_hf_config
from moetune.model.derive import derive_cached
from moetune.model.families.registry import (
    OVERRIDES,
    ExpertsLayout,
    Family,
    ModulePaths,
    Override,
    get_family,
)
from moetune.model.remote import prepare as prepare_remote
from moetune.model.sources import catalog_ids, catalog_meta, resolve_config
from moetune.model.spec import Components, ModelSpec


def load_spec(model: str, trust_remote_code: bool = False) -> ModelSpec:
    """The spec of `model`: a local dir with config.json, a .json file, a bundled id or a hub id.
    `trust_remote_code` runs the modeling code a checkpoint ships (model.remote)."""
    name, config = resolve_config(model)
    prepare_remote(name, config, trust_remote_code)
    return spec_from_config(config, name)


def spec_from_config(cfg: dict[str, Any], name: str = "custom") -> ModelSpec:
    """The spec of a config.json dict, read off transformers' own meta build (any model type
    transformers ships). UnknownFamilyError when model_type is missing or transformers does
    not know it."""
    return derive_cached(cfg, name).spec


__all__ = [
    "OVERRIDES",
    "Components",
    "ExpertsLayout",
    "Family",
    "ModelSpec",
    "ModulePaths",
    "Override",
    "build_model",
    "catalog_ids",
    "catalog_meta",
    "get_family",
    "load_spec",
    "resolve_config",
    "spec_from_config",
    "to_hf_config",
]
