"""The decoder layers of a built model, found by the family's layers prefix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moetune.errors import RecipeError

if TYPE_CHECKING:
    from torch import nn

    from moetune.model.families import Family
    from moetune.model.spec import ModelSpec


def decoder_layers(model: nn.Module, spec: ModelSpec, family: Family) -> list[nn.Module]:
    """The decoder layers of a (peft-wrapped) transformers model."""
    # lazy: heavy to import (torch)
    from torch import nn

    get_base = getattr(model, "get_base_model", None)
    base: nn.Module = get_base() if callable(get_base) else model
    try:
        layers = base.get_submodule(family.layers_prefix)
    except AttributeError:
        layers = None
    if isinstance(layers, nn.ModuleList) and len(layers) == spec.num_layers:
        return list(layers)
    raise RecipeError(
        f"cannot find {spec.num_layers} decoder layers at {family.layers_prefix!r} in {spec.name}",
        f"fix layers_prefix of the {family.model_type} family in moetune.model",
    )
