"""What moetune knows of a model_type: module paths, expert layout and layer prefix read
off a tiny transformers build of it, plus an `Override` (model.families.overrides) for what no build
shows – mlx-lm's key names, peft's quirks. Any model type gets a Family; none needs an
override.

This module holds the override registry and imports none of the overrides: importing
moetune.model.families registers them (overrides.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cache

from moetune.errors import UnknownFamilyError
from moetune.model.census import shrunk_config
from moetune.model.derive import derive_cached
from moetune.model.layout_types import ExpertsLayout, ModulePaths, Override
from moetune.model.spec import ModelSpec
from moetune.registry import Registry

__all__ = ["OVERRIDES", "ExpertsLayout", "Family", "ModulePaths", "Override", "get_family"]


@dataclass(frozen=True)
class Family(Override):
    """An override completed by a tiny build of its type (the classes, not the sizes, fix
    where the layers live and how the experts are stored)."""

    # the tiny build's, the override's mlx keys merged
    paths: ModulePaths = field(default_factory=ModulePaths)
    layout: ExpertsLayout = field(default_factory=ExpertsLayout)
    layers_prefix: str = "model.layers"  # ModulePaths are relative to `<layers_prefix>.<i>.`

    def paths_of(self, spec: ModelSpec) -> ModulePaths:
        """The module paths of the model `spec` describes: peft's read off its own build,
        mlx-lm's from the override."""
        if not spec.mixers:  # a spec not read off a build (hand-made): the type's paths
            return self.paths
        return self.merged(derive_cached(spec.hf_config, spec.name).paths)


OVERRIDES: Registry[Override] = Registry("model override", UnknownFamilyError)


def register(*overrides: Override) -> None:
    """Register each override under its model_type and aliases."""
    for over in overrides:
        for key in (over.model_type, *over.aliases):
            OVERRIDES.add(key, over)


@cache
def get_family(model_type: str) -> Family:
    """The family of `model_type`: a tiny build of it, with its override where one is
    registered (transformers must know the type)."""
    if model_type in OVERRIDES:
        over = OVERRIDES.get(model_type)
    else:  # nothing known of mlx-lm, and peft's automap left unclaimed
        over = Override(model_type, mlx_supported=False, peft_automap=False)
    tiny = derive_cached(shrunk_config(model_type), model_type)
    known = {f.name: getattr(over, f.name) for f in fields(Override)}
    return Family(
        **known,
        paths=over.merged(tiny.paths),
        layout=tiny.layout,
        layers_prefix=tiny.layers_prefix,
    )
