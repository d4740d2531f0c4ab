"""Tiny trained-looking runs for the export tests: a random tiny base of one family saved
with the demo's character tokenizer, a peft adapter on attention + every expert with
random (seeded) B matrices, and a run dir (config.yaml, adapter/, eval items)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from peft import LoraConfig, get_peft_model

from moetune.config import dump_config, parse_config
from moetune.demo.tokenizer import build_tokenizer, save_tokenizer
from moetune.model.tiny import tiny_config

FAMILIES = ["qwen3_moe-dense0", "gpt_oss", "olmoe"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PROMPTS = ["copy:abc>", "rev:hello>", "first:xyz>", "sum:123>", "copy:moe>", "rev:lora>"]


def make_base(root: Path, variant: str, dtype: torch.dtype = torch.float32, **over: Any) -> Path:
    """A tiny random base of `variant` saved in `dtype` with the demo tokenizer (vocab 64)."""
    torch.manual_seed(0)
    fields = {**tiny_config(variant), "vocab_size": 64, **over}
    config = transformers.AutoConfig.for_model(**fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    base = root / f"base-{variant}"
    model.save_pretrained(str(base))
    save_tokenizer(build_tokenizer(), base)
    return base


def make_adapter(
    base: Path,
    out: Path,
    scale: float = 0.3,
    experts: list[str] | None = None,
    modules: list[str] | None = None,
    **lora: Any,
) -> Path:
    """A peft adapter on q/o (or `modules`) + the expert stacks, every B random (seeded)
    so ΔW ≠ 0."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        config = LoraConfig(
            r=lora.pop("r", 2), lora_alpha=lora.pop("lora_alpha", 4),
            target_modules=modules or ["q_proj", "o_proj"],
            target_parameters=EXPERTS if experts is None else experts, **lora,
        )  # fmt: skip
        wrapped = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    wrapped.save_pretrained(str(out))
    return out


def make_run(
    root: Path,
    variant: str,
    base_over: dict[str, Any] | None = None,
    base: Path | None = None,
    **adapter: Any,
) -> Path:
    """A run dir like `moetune train` leaves: config.yaml, adapter/, and its eval items
    (on `base` when given, else a tiny base of `variant`)."""
    base = base or make_base(root, variant, **(base_over or {}))
    run = root / f"run-{variant}"
    make_adapter(base, run / "adapter", **adapter)
    data = root / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in PROMPTS))
    cfg = parse_config(
        {
            "model": {"id": str(base), "dtype": "float32"},
            "output": {"dir": str(run), "ledger": str(root / "ledger.jsonl")},
            "eval": {"rungs": [{"name": "skills", "kind": "exact_match", "data": str(data)}]},
        }
    )
    (run / "config.yaml").write_text(dump_config(cfg))
    return run
