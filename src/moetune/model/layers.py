"""The decoder layers of a built model, found by the family's layers prefix (in a
multimodal build: under its language model, model.multimodal)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from moetune.errors import RecipeError
from moetune.model.multimodal import language_layers

if TYPE_CHECKING:
    from torch import nn

    from moetune.model.families.registry import Family
    from moetune.model.spec import ModelSpec


def layers_prefix(model: nn.Module, spec: ModelSpec, family: Family) -> str:
    """Where the decoder layers of a (peft-wrapped) model sit: the family's prefix, or in a
    multimodal checkpoint's own class, the path under its language model."""
    base = _base(model)
    if _holds_layers(base, family.layers_prefix, spec.num_layers):
        return family.layers_prefix
    inner = language_layers(base, spec.model_type, spec.num_layers)
    if inner is not None and _holds_layers(base, inner, spec.num_layers):
        return inner
    raise RecipeError(
        f"cannot find {spec.num_layers} decoder layers at {family.layers_prefix!r} in {spec.name}",
        f"fix layers_prefix of the {family.model_type} family in moetune.model",
    )


def _holds_layers(base: nn.Module, prefix: str, count: int) -> bool:
    # lazy: heavy to import (torch)
    from torch import nn

    try:
        layers = base.get_submodule(prefix)
    except AttributeError:
        return False
    return isinstance(layers, nn.ModuleList) and len(layers) == count


def decoder_layers(model: nn.Module, spec: ModelSpec, family: Family) -> list[nn.Module]:
    """The decoder layers of a (peft-wrapped) transformers model."""
    layers = _base(model).get_submodule(layers_prefix(model, spec, family))
    return list(cast("nn.ModuleList", layers))


def _base(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model
