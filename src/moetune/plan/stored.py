"""How a plan holds a published quantised base (FP8 / MXFP4 / NVFP4 / INT4 checkpoints).

With `model.quantized_base: as_stored` (LoRA on moetune's split engine) the routed expert
stacks stay in the checkpoint's bytes and every other quantised Linear is dequantised to
`model.dtype` at load; otherwise the experts are planned as the run holds them (dequantised,
or re-stored as int8 / NF4). The format is asked for its label and bytes; none is named here.
"""

from __future__ import annotations

from typing import Any

from moetune.config import RunConfig
from moetune.model.spec import ModelSpec
from moetune.plan.moves import Storage, with_lora, with_model
from moetune.plan.step import Step, bnb_linear_bytes
from moetune.units import gib


def refuse_unreadable(spec: ModelSpec) -> None:
    """Raise the QuantError of a base published in a format moetune cannot read (naming the
    format, the ones it reads and the fix), before anything is sized or loaded: `inspect`,
    `plan`, `lint` and `train` all ask here, so a refusal is the same everywhere instead of
    a plan that "fits" a base its loader then refuses."""
    # lazy: heavy to import (torch via moetune.engine)
    from moetune.engine.stored.formats import stored_format

    stored_format(spec.quant_config)  # decided once per process; raises for an unreadable one


def published_format(spec: ModelSpec) -> str:
    """How a person names the published format moetune can keep the base's experts in
    ("MXFP4", "block FP8"); "" for a float base or one moetune cannot read."""
    # lazy: heavy to import (torch via moetune.engine)
    from moetune.engine.resolve import stored_experts

    fmt = stored_experts(spec)
    return fmt.label.split(" (")[0] if fmt else ""  # "MXFP4 (quant_method mxfp4)" -> "MXFP4"


def held_as(spec: ModelSpec, cfg: RunConfig) -> str:
    """How `cfg` holds the frozen experts, in words: NF4, as published, or the model dtype."""
    if cfg.model.experts_dtype == "nf4":
        return "experts as NF4"
    if Step.from_config(cfg, spec).stored_bytes:
        return f"experts as published {published_format(spec)}"
    return cfg.model.dtype


def restored(cfg: RunConfig, storage: Storage) -> RunConfig:
    """`cfg` with its frozen experts stored as `storage` (int8 / NF4) on moetune's engine."""
    dq = {"experts_double_quant": True} if storage.double_quant else {}
    return with_model(with_lora(cfg, engine="moetune"), experts_dtype=storage.dtype, **dq)


def stored_summary(spec: ModelSpec, cfg: RunConfig) -> dict[str, Any] | None:
    """What `--json` carries about a published quantised base (None: a float checkpoint or
    one moetune cannot read, planned as float)."""
    # lazy: heavy to import (torch via moetune.engine)
    from moetune.engine.resolve import stored_experts

    fmt = stored_experts(spec)
    if fmt is None:
        return bnb_summary(spec, cfg)
    step = Step.from_config(cfg, spec)
    kept = bool(step.stored_bytes)
    per_param = step.stored_bytes if kept else fmt.bytes_per_param(spec.quant_config or {})
    routed = spec.components.routed_experts
    return {
        "format": fmt.label,
        "as_stored": kept,
        "bytes_per_param": per_param,
        "routed_experts_params": routed,
        "routed_experts_bytes": round(routed * per_param),
        "rest_dtype": cfg.model.dtype,
        "linears_as_stored": bool(step.stored_linear_bytes),
        "text": _words(published_format(spec), kept, round(routed * per_param), cfg, step),
    }


def _words(name: str, kept: bool, routed_bytes: int, cfg: RunConfig, step: Step) -> str:
    if kept:
        linears = step.stored_linear_bytes
        rest = "attention, dense and shared MLP Linears as published too, " if linears else ""
        held = f"{name}, {gib(routed_bytes)}; {rest}the rest in {cfg.model.dtype}"
        return f"routed experts as published: {held}"
    held = cfg.model.experts_dtype if cfg.model.experts_dtype != "bf16" else cfg.model.dtype
    return (
        f"the base is published {name} ({gib(routed_bytes)} of routed experts): "
        f"planned with them as {held} – as_stored keeps them as published for LoRA on "
        "lora.engine moetune with model.experts_dtype bf16"
    )


def bnb_summary(spec: ModelSpec, cfg: RunConfig) -> dict[str, Any] | None:
    """stored_summary's view of a bitsandbytes pre-quantised base: its Linears planned as the
    bytes it stores, the rest (the fused experts among it) in model.dtype. None otherwise."""
    per_param = bnb_linear_bytes(spec)
    if not per_param:
        return None
    bits = 8 if (spec.quant_config or {}).get("load_in_8bit") else 4
    c = spec.components
    linears = round((c.attention + c.dense_mlp + c.shared_experts) * per_param)
    return {
        "format": f"bitsandbytes {bits}-bit",
        "as_stored": True,
        "bytes_per_param": per_param,
        "routed_experts_params": c.routed_experts,
        "routed_experts_bytes": 0,
        "rest_dtype": cfg.model.dtype,
        "linears_as_stored": True,
        "text": f"the base is published bitsandbytes {bits}-bit: its attention, dense and "
        f"shared MLP Linears planned as stored ({gib(linears)}); bitsandbytes leaves the "
        f"routed experts, router, embeddings and lm_head float: in {cfg.model.dtype}",
    }
