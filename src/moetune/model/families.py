"""Registry of MoE families keyed by config.json `model_type`.

Each family knows how to read its config (aliased spellings included), which layers
are MoE, how to count parameters by component, and where its modules live for peft
and mlx-lm. Extend by decorating a Family factory with `@register`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moetune.errors import UnknownFamilyError
from moetune.model.spec import ModelSpec


@dataclass(frozen=True)
class ModulePaths:
    """Names relative to one decoder layer (`model.layers.<i>.`), as peft and mlx-lm see them.

    peft fields are dotted module paths of nn.Linear leaves (or, for `expert_params`,
    fused nn.Parameter paths for `LoraConfig.target_parameters`). An empty tuple means
    the family has no such part.
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


@dataclass(frozen=True)
class ExpertsLayout:
    """How transformers stores the fused expert stacks (the `@use_experts_implementation` flags)."""

    is_concatenated: bool = True  # gate/up as halves (False: interleaved [..., ::2])
    is_transposed: bool = False  # [E, in, out] instead of [E, out, in]
    has_bias: bool = False


@dataclass(frozen=True)
class Family:
    """One model_type: config reading, parameter counting and module paths."""

    model_type: str
    build_spec: Callable[[dict[str, Any], str], ModelSpec]  # (config dict, name) -> spec
    paths: ModulePaths
    layout: ExpertsLayout = ExpertsLayout()
    peft_automap: bool = True  # peft >= 0.19 maps gate/up/down_proj names onto fused experts
    mlx_supported: bool = True
    aliases: tuple[str, ...] = ()  # other model_type strings served by this family


FAMILIES: dict[str, Family] = {}


def register(factory: Callable[[], Family]) -> Callable[[], Family]:
    """Register the Family a factory returns under its model_type and aliases."""
    fam = factory()
    for key in (fam.model_type, *fam.aliases):
        FAMILIES[key] = fam
    return factory


def get_family(model_type: str) -> Family:
    """The registered family for `model_type`, or UnknownFamilyError naming the supported ones."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise UnknownFamilyError(
            f"unknown model_type {model_type!r}",
            f"moetune supports: {known}; open an issue to add a family",
        ) from None
