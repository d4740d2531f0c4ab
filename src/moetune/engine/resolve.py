"""Which engine computes the expert LoRA of a run: `lora.engine` auto, moetune or peft.

moetune's split LoRA serves every family whose experts class transformers decorates with
`@use_experts_implementation` (its forward dispatches through `ExpertsInterface`). That
is probed on the installed transformers by building the model on the meta device – no
table to go stale – and cached per model type. `auto` (the default) picks moetune where
it serves and the run adapts experts, peft otherwise; an explicit `moetune` on a family
it cannot serve is an error with the fix, never a silent fallback.

The choice is decided once per process for the inputs it reads (`engine_key`): the plan,
the lint rules, the recipe and the trainer all ask, and a recommendation's variant (other
experts dtype, other targets) has another key, so it is decided afresh, never handed the
answer of another configuration.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from moetune.config import LoraArgs
from moetune.config.keys import lora_stack, splits, wraps
from moetune.engine.quant.stacks import QuantError
from moetune.engine.stored.formats import StoredFormat, stored_format
from moetune.errors import RecipeError
from moetune.model.build import build_model
from moetune.model.spec import ModelSpec

Engine = Literal["peft", "moetune"]


def resolve_engine(
    spec: ModelSpec, lora: LoraArgs, experts_dtype: str = "bf16", quantized_base: str = "as_stored"
) -> Engine:
    """The engine a run with `lora` on `spec` trains (and is planned) with.

    It matters where the experts carry LoRA or are stored quantised (`experts_dtype`, or a
    published quantised base kept as stored: `model.quantized_base`): quantised stacks run
    one expert at a time on moetune's path, LoRA or not. Decided once per process for the
    inputs it reads (`engine_key`): the plan, the rules, the recipe and the trainer all ask,
    and a recommendation's variant (another experts dtype, other targets) has another key,
    so it is decided afresh, never handed another configuration's answer.
    """
    key = engine_key(spec, lora, experts_dtype, quantized_base)
    if key not in _ENGINES:  # an error is not kept: each caller raises it anew
        _ENGINES[key] = decide_engine(spec, lora, experts_dtype, quantized_base)
    return _ENGINES[key]


def engine_key(spec: ModelSpec, lora: LoraArgs, experts_dtype: str, quantized_base: str) -> tuple:
    """Everything `decide_engine` reads, as a key: the model type (what transformers
    builds), whether it is an MoE, its published quantisation, and the run's choices."""
    stored = json.dumps(spec.quant_config, sort_keys=True, default=str)
    targets_experts = "experts" in lora.targets
    return (spec.model_type, spec.is_moe, stored, lora.engine, lora.stack, targets_experts,
            experts_dtype, quantized_base)  # fmt: skip


def decide_engine(
    spec: ModelSpec, lora: LoraArgs, experts_dtype: str, quantized_base: str
) -> Engine:
    """The decision itself (resolve_engine keeps it for the process)."""
    quantised = experts_dtype != "bf16" or stored_experts(spec, quantized_base) is not None
    uses_experts = "experts" in lora.targets or quantised
    peft_only = wraps(lora.engine) or not lora_stack(lora.stack).peft_adapter  # asked; mlx
    if peft_only or not (spec.is_moe and uses_experts):
        return "peft"
    served = split_engine_serves(spec)
    if splits(lora.engine) and not served:
        raise RecipeError(
            f"lora.engine moetune cannot serve {spec.model_type}: transformers does not "
            "dispatch its experts through ExpertsInterface (@use_experts_implementation)",
            "set lora.engine: auto or peft",
        )
    return "moetune" if served else "peft"


def stored_experts(spec: ModelSpec, quantized_base: str = "as_stored") -> type[StoredFormat] | None:
    """The published format a run keeps `spec`'s routed expert stacks in: None for a float
    checkpoint, for `model.quantized_base: dequantize`, and for a format moetune cannot read
    (the loader refuses that one; a plan sizes it as float)."""
    if quantized_base != "as_stored" or not spec.quant_config:
        return None
    try:
        return stored_format(spec.quant_config)
    except QuantError:
        return None


def stored_options(spec: ModelSpec, quantized_base: str = "as_stored") -> dict[str, Any] | None:
    """The blocks / groups of a base kept as stored (StoredFormat.options), else None."""
    fmt = stored_experts(spec, quantized_base)
    return None if fmt is None or spec.quant_config is None else fmt.options(spec.quant_config)


def split_engine_serves(spec: ModelSpec) -> bool:
    """Whether the installed transformers builds `spec`'s experts as dispatchable stacks.

    It depends on the family's experts class only, so one meta build per model type.
    """
    if spec.model_type not in _SERVES:
        # lazy: heavy to import (moetune.engine)
        from moetune.engine.experts_lora import is_fused_experts

        _SERVES[spec.model_type] = any(map(is_fused_experts, build_model(spec).modules()))
    return _SERVES[spec.model_type]


_SERVES: dict[str, bool] = {}
_ENGINES: dict[tuple, Engine] = {}
