"""Registry of MoE families keyed by config.json `model_type`.

Each family knows how to read its config (aliased spellings included), which layers
are MoE, how to count parameters by component, and where its modules live for peft
and mlx-lm. Extend by decorating a Family factory with `@register`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from moetune.model.spec import ModelSpec


@dataclass(frozen=True)
class ModulePaths:
    """Names relative to one decoder layer (`<Family.layers_prefix>.<i>.`, usually
    `model.layers.<i>.`), as peft and mlx-lm see them.

    `attention` holds the Linear leaf names (peft `target_modules` style, e.g. "q_proj");
    the other peft fields are dotted paths of nn.Linear modules, `router` of the router
    module (a Linear or a `…TopKRouter`), and `expert_params` of the fused nn.Parameters
    for `LoraConfig.target_parameters`. mlx fields are mlx-lm `lora_parameters.keys`.
    An empty tuple means the family has no such part (or, for mlx, nothing adaptable).
    """

    attention: tuple[str, ...]
    expert_params: tuple[str, ...]
    dense_mlp: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()
    router: tuple[str, ...] = ()
    mlx_attention: tuple[str, ...] = ()
    mlx_experts: tuple[str, ...] = ()
    mlx_dense: tuple[str, ...] = ()
    mlx_shared: tuple[str, ...] = ()
    mlx_router: tuple[str, ...] = ()
    # Derived from a build: per decoder layer, the paths above that layer really has
    # (hybrid models mix mixers and MLP kinds); empty means every layer has every path.
    present: tuple[frozenset[str], ...] = ()

    def in_layer(self, layer: int, path: str) -> bool:
        """Whether decoder layer `layer` should have `path`: always for hand-written tables,
        and for a path no layer has (a wrong name must be reported, not skipped)."""
        if not self.present or layer >= len(self.present) or path in self.present[layer]:
            return True
        return not any(path in found for found in self.present)  # a path no layer has: a miss


_MLX_FIELDS = tuple(f.name for f in fields(ModulePaths) if f.name.startswith("mlx_"))


@dataclass(frozen=True)
class ExpertsLayout:
    """How transformers stores the fused expert stacks (the `@use_experts_implementation` flags)."""

    is_concatenated: bool = True  # gate/up as halves (False: interleaved [..., ::2])
    is_transposed: bool = False  # [E, in, out] instead of [E, out, in]
    has_bias: bool = False
    # False: gate and up are separate parameters (dbrx w1/v1), nothing to de-concatenate.
    fused_gate_up: bool = True
    # True: 2-D [E*I, H] stacks (dbrx) rather than 3-D [E, ., .]; view as [E, I, H] per expert.
    flat_2d: bool = False
    # True: transformers' `@use_experts_implementation` drives these experts (ExpertsInterface).
    experts_interface: bool = True


@dataclass(frozen=True)
class Family:
    """One model_type: config reading, parameter counting and module paths."""

    model_type: str
    build_spec: Callable[[dict[str, Any], str], ModelSpec]  # (config dict, name) -> spec
    paths: ModulePaths
    layout: ExpertsLayout = ExpertsLayout()
    peft_automap: bool = True  # peft >= 0.19 maps gate/up/down_proj names onto fused experts
    # Other target_modules names peft maps onto the fused experts (mixtral: its checkpoint
    # names w1/w2/w3; gate/up/down_proj match nothing there).
    peft_automap_names: tuple[str, ...] = ()
    mlx_supported: bool = True
    aliases: tuple[str, ...] = ()  # other model_type strings served by this family
    # Where the decoder layers live; ModulePaths are relative to `<layers_prefix>.<i>.`.
    layers_prefix: str = "model.layers"
    # Config-dependent module names (e.g. DeepSeek's q_proj vs q_a_proj/q_b_proj); `paths`
    # then holds the union of every variant.
    paths_for: Callable[[ModelSpec], ModulePaths] | None = None

    def paths_of(self, spec: ModelSpec) -> ModulePaths:
        """The module paths that exist in the model `spec` describes: peft's read off the
        build, mlx-lm's (which no transformers build shows) from this family's table."""
        own = self.paths_for(spec) if self.paths_for else self.paths
        if not spec.mixers:  # a spec that did not come from a build
            return own
        from moetune.model.derive import derive_cached

        built = derive_cached(spec.hf_config, spec.name).paths
        mlx = {f: getattr(own, f) for f in _MLX_FIELDS}
        return replace(built, **mlx)


FAMILIES: dict[str, Family] = {}


def register(factory: Callable[[], Family]) -> Callable[[], Family]:
    """Register the Family a factory returns under its model_type and aliases."""
    fam = factory()
    for key in (fam.model_type, *fam.aliases):
        FAMILIES[key] = fam
    return factory


def get_family(model_type: str) -> Family:
    """The family for `model_type`: a hand-written override where one is registered,
    else one derived from transformers' own build (UnknownFamilyError if it has none)."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    from moetune.model.generic import generic_family

    return generic_family(model_type)
