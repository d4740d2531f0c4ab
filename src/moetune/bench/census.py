"""The census by tier: of the installed transformers' decoder MoE types (model.census), how
many moetune counts exactly, recipes at 100 %, plans analytically, traces exactly, and trains.

Each tier is a check on the type's tiny config (model.census.shrunk_config) that says "ok"
or, in one line, why not. The cheap tiers (count, recipe, plan) take seconds for every type;
trace and train take tens of minutes on a laptop, so `benchmarks/census_tiers.py` records
them in `benchmarks/census_tiers.json` and docs/plan.md quotes that record.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetune.config import LoraArgs, RunConfig, parse_config
from moetune.errors import MoetuneError, clip
from moetune.model import ModelSpec, spec_from_config, to_hf_config
from moetune.model.census import moe_model_types, shrunk_config
from moetune.model.derive import build_language_model
from moetune.plan import make_plan
from moetune.plan.profiles.registry import uncalibrated
from moetune.plan.trace.fake_step import trace_step
from moetune.recipe.targets import build_peft_config, make_recipe

TIERS = ("count", "recipe", "plan", "trace", "train")
CHEAP = TIERS[:3]
LORA = LoraArgs.model_validate({"rank": 4, "targets": ["attention", "experts"], "engine": "peft"})
OK = "ok"


def spec_of(model_type: str) -> ModelSpec:
    return spec_from_config(shrunk_config(model_type), model_type)


def count(model_type: str, _: Path) -> str:
    """The spec's total equals every parameter of transformers' own build, counted apart."""
    spec = spec_of(model_type)
    built = build_language_model(to_hf_config(spec), model_type)
    numel = sum(p.numel() for p in built.parameters())
    if not spec.is_moe or spec.components.routed_experts <= 0:
        return "no routed experts read off the build"
    return OK if spec.total_params == numel else f"counted {spec.total_params}, built {numel}"


def recipe(model_type: str, _: Path) -> str:
    """LoRA reaches every requested target (every expert stack) and leaves the router frozen."""
    report = make_recipe(spec_of(model_type), LORA).coverage
    frozen = all(state == "frozen" for state in report.router.values())
    return OK if report.coverage == 1.0 and frozen else f"coverage {report.coverage:.0%}"


def _run_config(model: str, **train: Any) -> RunConfig:
    return parse_config({"model": {"id": model}, "lora": LORA.model_dump(), "train": train})


def plan(model_type: str, _: Path) -> str:
    """The analytic planner sizes it by itself (no silent fall-back to the trace)."""
    spec = spec_of(model_type)
    missing = uncalibrated(spec)
    if missing:
        return f"no calibrated activation term for {', '.join(missing)} (plan traces instead)"
    result = make_plan(spec, _run_config(model_type, seq_len=64), estimator="analytic")
    return OK if result.estimator == "analytic" and result.peak_bytes > 0 else "no analytic peak"


def traced_and_real(spec: ModelSpec) -> tuple[int, int]:
    """Peak bytes of one LoRA step of `spec`: traced under fake tensors, and run for real."""
    peft = build_peft_config(spec, LORA)
    fake, real = (
        trace_step(to_hf_config(spec), peft, seq_len=16, loss="full",
                   gradient_checkpointing=False, fake=is_fake)
        for is_fake in (True, False)
    )  # fmt: skip
    return fake.peak_bytes, real.peak_bytes


def trace(model_type: str, _: Path) -> str:
    """The fake-tensor trace of one step equals the same step run for real on the CPU."""
    fake, real = traced_and_real(spec_of(model_type))
    return OK if fake == real else f"{fake} vs {real}"


def train(model_type: str, work: Path) -> str:
    """Five LoRA steps on a saved tiny checkpoint: coverage 1, router unchanged."""
    # lazy: heavy to import (the trainer: trl, datasets)
    from moetune.train.trainer import train as run_training

    model = save_tiny(model_type, work / "model")
    data = work / "train.jsonl"
    rows = [{"prompt": f"rev:{w}>", "completion": w[::-1]} for w in ("moe", "lora", "tier") * 4]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cls = type(build_language_model(to_hf_config(spec_of(model_type)), model_type))
    gc = cls.supports_gradient_checkpointing  # jetmoe refuses it (lint: GC-UNSUPPORTED)
    section = {"max_steps": 5, "save_steps": 5, "batch_size": 2, "seq_len": 16,
               "device": "cpu", "gradient_checkpointing": gc}  # fmt: skip
    cfg = parse_config({
        "model": {"id": str(model)}, "lora": {"rank": 4}, "data": {"train_file": str(data)},
        "output": {"dir": str(work / "run"), "ledger": str(work / "ledger.jsonl")},
        "train": section,
    })  # fmt: skip
    result = run_training(cfg, progress=False)
    done = (result.steps, result.coverage, result.router_changed) == (5, 1.0, False)
    return OK if done else f"{result.steps} steps, coverage {result.coverage:.0%}"


def save_tiny(model_type: str, out: Path) -> Path:
    """A tiny random fp32 checkpoint of `model_type` with the demo's character tokenizer."""
    # lazy: heavy to import (torch)
    import torch

    from moetune.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    config = to_hf_config(spec_of(model_type))
    for name in ("pad", "eos", "bos"):
        setattr(config, f"{name}_token_id", getattr(tok, f"{name}_token_id"))
    torch.manual_seed(0)
    build_language_model(config, model_type, device="cpu", dtype=torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


CHECKS: dict[str, Callable[[str, Path], str]] = {
    "count": count, "recipe": recipe, "plan": plan, "trace": trace, "train": train,
}  # fmt: skip


def status(model_type: str, tier: str, work: Path) -> str:
    """ "ok", or why `model_type` does not pass `tier` (one line)."""
    try:
        return CHECKS[tier](model_type, work)
    except MoetuneError as exc:
        return clip(exc.cause, 200)
    except Exception as exc:  # a library failure inside the tier is its result, not a crash
        return clip(f"{type(exc).__name__}: {exc}", 200)


def tier_counts(statuses: dict[str, dict[str, str]]) -> dict[str, int]:
    """How many types pass each tier recorded in `statuses` (type -> tier -> status)."""
    tiers = [t for t in TIERS if any(t in s for s in statuses.values())]
    return {t: sum(s.get(t) == OK for s in statuses.values()) for t in tiers}


def census_tiers(tiers: tuple[str, ...], work: Path, types: list[str] | None = None) -> dict:
    """type -> tier -> status, over `types` (default: every decoder MoE type installed)."""
    out: dict[str, dict[str, str]] = {}
    for model_type in types if types is not None else moe_model_types():
        scratch = work / model_type
        scratch.mkdir(parents=True, exist_ok=True)
        out[model_type] = {tier: status(model_type, tier, scratch) for tier in tiers}
    return out
