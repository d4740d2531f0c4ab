"""Turn a ModelSpec back into transformers objects: its config, or a weightless model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moetune.model.derive import build_language_model, to_hf_config
from moetune.model.spec import ModelSpec

__all__ = ["build_model", "to_hf_config"]

if TYPE_CHECKING:
    import torch


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
