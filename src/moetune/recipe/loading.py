"""The code that loads a base the way its run is planned, through the Python API
(`moetune.load`, docs/api.md): the resolved engine, the experts' dtype, a published
quantised base kept as stored, offload – and why plain peft would not load it so."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from moetune.config.keys import offload_mode
from moetune.engine.resolve import resolve_engine, stored_experts

if TYPE_CHECKING:
    from moetune.config import RunConfig
    from moetune.model.spec import ModelSpec

# the run.yaml fields that decide how the base loads and what LoRA it gets
_MODEL = ("experts_dtype", "experts_double_quant", "quantized_base", "dtype", "trust_remote_code")
# seq_len, batch_size and checkpointing too: load() lints and plans the run as it trains
_TRAIN = (
    "offload",
    "seed",
    "device",
    "precision",
    "seq_len",
    "batch_size",
    "gradient_checkpointing",
)


def load_plan(spec: ModelSpec, run: RunConfig) -> dict[str, Any]:
    """{"code": python that loads as planned, "engine": the resolved engine, "needs_moetune":
    why plain peft's get_peft_model would not train it as planned (empty: it would)}."""
    m = run.model
    engine = resolve_engine(spec, run.lora, m.experts_dtype, m.quantized_base)
    stored = stored_experts(spec, m.quantized_base)
    why = []
    if engine == "moetune":
        why.append("moetune's split engine trains the experts' LoRA one expert at a time")
    if m.experts_dtype != "bf16":
        why.append(f"the frozen experts are held {m.experts_dtype} (model.experts_dtype)")
    if stored is not None:
        why.append(f"the base is read as stored: {stored.label}")
    if offload_mode(run.train.offload).streams:
        why.append(f"frozen experts stream from {run.train.offload} (train.offload)")
    return {"code": _code(run, engine), "engine": engine, "needs_moetune": why}


def _code(run: RunConfig, engine: str) -> str:
    """`moetune.load(...)` with every field that differs from run.yaml's defaults."""
    defaults = type(run)()
    sections = {
        "model": _changed(run.model, defaults.model, _MODEL),
        "lora": {**_changed(run.lora, defaults.lora, None), "engine": engine},
        "train": _changed(run.train, defaults.train, _TRAIN),
    }
    args = "".join(f"    {name}={value!r},\n" for name, value in sections.items() if value)
    return (
        "import moetune\n\n"
        f"model, tokenizer = moetune.load(\n    {json.dumps(run.model.id)},\n{args})\n"
    )


def _changed(section: Any, default: Any, fields: tuple[str, ...] | None) -> dict[str, Any]:
    now, was = section.model_dump(mode="json"), default.model_dump(mode="json")
    names = fields if fields is not None else tuple(now)
    return {k: now[k] for k in names if now[k] != was[k]}
