"""Per-model-type fixes that make a peft-wrapped model really apply its expert LoRA.

peft's `ParamWrapper` adapts a parameter only while the wrapper's own forward runs (a
parametrization). A family whose experts forward reads its stacks *outside* the wrapped
module (dbrx: `DbrxExperts` reads `mlp.w1` and passes slices into `mlp(...)`) therefore
breaks on peft, or would train nothing. An override, registered by model type, gives such
modules a forward that applies peft's own `lora_A` / `lora_B`, so the adapter stays a
standard peft adapter. `apply_overrides` runs wherever moetune prepares a peft model (the
trainer, the planner's trace, the eval ladder); families without one are left as they are.
The overrides themselves (dbrx.py) are registered by importing moetune.engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from moetune.engine.experts_lora import EngineError
from moetune.registry import Registry

EngineFix = Callable[[nn.Module], int]  # transformers model -> how many modules it changed
ENGINE_OVERRIDES: Registry[EngineFix] = Registry("engine override", EngineError)


def register_override(model_type: str) -> Callable[[EngineFix], EngineFix]:
    """Register the override for `model_type` (config.json's model_type)."""
    return ENGINE_OVERRIDES.register(model_type)


def apply_overrides(model: nn.Module) -> int:
    """Apply the override registered for `model`'s type (a PeftModel or the transformers
    model under it); returns how many modules it changed (0: none registered). Idempotent."""
    get_base = getattr(model, "get_base_model", None)
    base: Any = get_base() if callable(get_base) else model
    model_type = getattr(getattr(base, "config", None), "model_type", "")
    return ENGINE_OVERRIDES.get(model_type)(base) if model_type in ENGINE_OVERRIDES else 0
