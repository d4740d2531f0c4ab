"""The trace estimate for a run config, cached on disk so a rerun is instant.

A 30B step traces in 20–60 s; its result depends only on the model config, the LoRA
config, the step's shape and the installed torch / transformers / peft (and moetune's
tracer), so those form the cache key. Entries are small JSON files under
`$MOETUNE_CACHE_DIR/traces` (default `~/.cache/moetune/traces`), written to a temp file
and renamed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.config import RunConfig
from moetune.errors import ConfigError
from moetune.model import to_hf_config
from moetune.model.spec import ModelSpec
from moetune.plan.step import Step, bnb_linear_bytes
from moetune.recipe.targets import build_peft_config

if TYPE_CHECKING:
    from moetune.plan.trace.fake_step import TraceResult

STEPS = 2  # the steady state: Adam moments are live through forward and backward
_VERSIONED = ("torch", "transformers", "peft", "moetune")


def cache_dir() -> Path:
    root = os.environ.get("MOETUNE_CACHE_DIR") or Path.home() / ".cache" / "moetune"
    return Path(root) / "traces"


def _versions() -> dict[str, str]:
    out = {}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "?"
    return out


def _tracer_digest() -> str:
    """Changes to the tracer itself invalidate the cache too."""
    here = Path(__file__).parent
    engine = here.parent.parent / "engine"
    files = [
        here / "fake_step.py",
        here / "bytes.py",
        engine / "experts_lora.py",
        engine / "quant" / "stacks.py",
        engine / "quant" / "int8_nf4.py",
        engine / "stored" / "formats.py",
    ]
    text = b"".join(f.read_bytes() for f in files if f.exists())
    return hashlib.sha256(text).hexdigest()[:16]


def trace_key(spec: ModelSpec, cfg: RunConfig, optimizer: str) -> str:
    """A stable hash of everything the trace result depends on."""
    payload = {
        "model": spec.hf_config,
        "dtype": cfg.model.dtype,
        "experts": [cfg.model.experts_dtype, cfg.model.experts_double_quant],
        "stored": [cfg.model.quantized_base, spec.quant_config],
        "lora": None if cfg.train.tuning == "full" else cfg.lora.model_dump(mode="json"),
        "train": cfg.train.model_dump(mode="json"),
        "optimizer": optimizer,
        "steps": STEPS,
        "versions": _versions(),
        "tracer": _tracer_digest(),
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def run_trace(spec: ModelSpec, cfg: RunConfig, optimizer: str = "fused") -> TraceResult:
    """trace_step for `cfg` on `spec` (recipe's LoraConfig; None for full fine-tuning)."""
    # lazy: heavy to import (torch, peft via moetune.engine, moetune.plan.trace.fake_step)
    import torch

    from moetune.engine.resolve import resolve_engine, stored_options
    from moetune.plan.trace.fake_step import trace_step

    bnb = cfg.train.tuning == "qlora" or cfg.train.quantization != "none"
    if bnb or bnb_linear_bytes(spec):  # a bitsandbytes base (asked, or published so)
        raise ConfigError(
            "the trace estimator cannot run quantized (bitsandbytes) steps on fake tensors",
            "use --estimator analytic for qlora / bnb quantization",
        )
    step = Step.from_config(cfg, spec)
    peft_config = None
    if cfg.train.tuning != "full":  # sized without dropout: see planner.make_plan's notes
        peft_config = build_peft_config(spec, cfg.lora.model_copy(update={"dropout": 0.0}))
    return trace_step(
        to_hf_config(spec),
        peft_config,
        seq_len=cfg.train.seq_len,
        batch_size=cfg.train.batch_size,
        gradient_checkpointing=cfg.train.gradient_checkpointing,
        dtype=getattr(torch, cfg.model.dtype),
        optimizer=optimizer,
        steps=STEPS,
        engine=resolve_engine(spec, cfg.lora, cfg.model.experts_dtype, cfg.model.quantized_base),
        experts_dtype=step.stored_experts or cfg.model.experts_dtype,  # a base kept as stored
        double_quant=cfg.model.experts_double_quant,
        experts_options=stored_options(spec, cfg.model.quantized_base),
        stored_config=spec.quant_config if step.stored_experts else None,  # its ignore lists
    )


def is_cached(spec: ModelSpec, cfg: RunConfig, optimizer: str = "fused") -> bool:
    """Whether `cached_trace` would answer from the disk cache."""
    return _read(cache_dir() / f"{trace_key(spec, cfg, optimizer)}.json") is not None


def cached_trace(spec: ModelSpec, cfg: RunConfig, optimizer: str = "fused") -> TraceResult:
    """`run_trace`, read from / written to the disk cache."""
    # lazy: heavy to import (torch via moetune.plan.trace.fake_step)
    from moetune.plan.trace.fake_step import TraceResult

    path = cache_dir() / f"{trace_key(spec, cfg, optimizer)}.json"
    hit = _read(path)
    if hit is not None:
        try:
            return TraceResult(**hit)
        except TypeError:  # the result type changed: trace again
            pass
    result = run_trace(spec, cfg, optimizer)
    _write(path, dataclasses.asdict(result))
    return result


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        tmp.replace(path)
    except OSError:  # a read-only home only costs the next run a re-trace
        pass
