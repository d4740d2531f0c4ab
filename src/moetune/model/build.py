"""Turn a ModelSpec back into transformers objects: its config, or a weightless model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moetune.model.counting import hf_config_object
from moetune.model.derive import build_language_model
from moetune.model.spec import ModelSpec

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


def to_hf_config(spec: ModelSpec) -> PretrainedConfig:
    """The transformers config of the (text, bf16) model `spec` describes."""
    config = dict(spec.hf_config)
    model_type = str(config.pop("model_type", spec.model_type))
    return hf_config_object(model_type, config, spec.name)


def build_model(
    spec: ModelSpec,
    device: str | torch.device = "meta",
    dtype: str | torch.dtype | None = None,
    **from_config: Any,
) -> torch.nn.Module:
    """transformers' causal-LM class for the spec's config, built under `device`.

    On meta (the default) nothing is allocated and a 235B model builds in about half a
    second. `dtype` defaults to the spec's dtype; extra keyword arguments (e.g.
    `experts_implementation`, `attn_implementation`) go to from_config.
    """
    resolved = _dtype(dtype if dtype is not None else spec.dtype)
    config = to_hf_config(spec)
    return build_language_model(
        config, spec.name, device=str(device), dtype=resolved, **from_config
    )


def _dtype(value: str | torch.dtype) -> torch.dtype:
    # lazy: heavy to import (torch)
    import torch

    if isinstance(value, torch.dtype):
        return value
    resolved = getattr(torch, str(value).removeprefix("torch."), None)
    return resolved if isinstance(resolved, torch.dtype) else torch.bfloat16
