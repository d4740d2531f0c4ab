"""The family of any model type transformers builds, with no hand-written table.

Counts, components and module paths come from `model.derive` (a meta build read by
structure); a hand-written `Family` in `model.arch` is only an override for a known quirk
(mlx-lm key maps, peft's automap names).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from moetune.model.derive import derive_cached
from moetune.model.families import Family, ModulePaths
from moetune.model.spec import ModelSpec


def derived_spec(raw: dict[str, Any], name: str) -> ModelSpec:
    return derive_cached(raw, name).spec


def _paths(spec: ModelSpec) -> ModulePaths:
    return derive_cached(spec.hf_config, spec.name).paths


@cache
def generic_family(model_type: str) -> Family:
    """A Family whose every fact is read off a build (layout and layer prefix from a tiny
    build of the type: they depend on the classes, not the sizes)."""
    from moetune.model.census import tiny_config

    tiny = derive_cached(tiny_config(model_type), model_type)
    return Family(
        model_type=model_type,
        build_spec=derived_spec,
        paths=tiny.paths,
        layout=tiny.layout,
        peft_automap=False,
        mlx_supported=False,
        layers_prefix=tiny.layers_prefix,
        paths_for=_paths,
    )
