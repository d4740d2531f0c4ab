"""`moetune quickstart`: the whole local pipeline on the embedded tiny MoE, no download, no GPU.

plan → lint → train (LoRA on attention + every expert, audited, router frozen) → score the
base and the adapter on the same held-out items of every skill. The base knows copy /
reverse / first / digit-sum / key-value lookup; the fine-tune teaches it a new skill
while rows of the old skills are mixed back in so it keeps them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moetune.config import RunConfig, parse_config
from moetune.io import atomic_write_json


@dataclass(frozen=True)
class QuickstartArgs:
    """Knobs of the demo fine-tune; defaults learn the new skill in about a minute on 2 cores."""

    out_dir: Path = field(default_factory=lambda: Path("runs") / time.strftime("qs-%Y%m%d-%H%M%S"))
    new_skill: str = "last"  # the skill the fine-tune teaches (the base scores ~0 on it)
    new_share: float = 0.5  # fraction of training rows from the new skill; the rest replay old ones
    rows: int = 4000
    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 2e-3
    rank: int = 8
    eval_items: int = 64  # held-out items per skill, the same for base and candidate
    seed: int = 0


def training_rows(args: QuickstartArgs) -> list[dict[str, str]]:
    """New-skill rows mixed with replayed base-skill rows (train split only, seeded)."""
    from itertools import islice

    from moetune.demo.skills import base_skills, stream, to_prompt_completion

    n_new = int(args.rows * args.new_share)
    new = islice(stream([args.new_skill], args.seed, "train"), n_new)
    old = islice(stream(base_skills(), args.seed, "train"), args.rows - n_new)
    rows = to_prompt_completion([*new, *old])
    # interleave deterministically so every batch sees both kinds
    return rows[::2] + rows[1::2]


def run_config(args: QuickstartArgs, train_file: Path) -> RunConfig:
    """The run config the quickstart trains with (written beside its outputs like any run)."""
    from moetune.demo.base import MAX_LEN, SHIPPED_DIR

    return parse_config(
        {
            "model": {"id": str(SHIPPED_DIR), "dtype": "float32"},
            "lora": {"rank": args.rank, "targets": ["attention", "experts"]},
            "data": {"train_file": str(train_file)},
            "output": {
                "dir": str(args.out_dir / "run"),
                "ledger": str(args.out_dir / "ledger.jsonl"),
            },
            "train": {
                "seq_len": MAX_LEN,
                "batch_size": args.batch_size,
                "gradient_checkpointing": False,
                "learning_rate": args.learning_rate,
                "lr_scheduler": "cosine",
                "warmup_ratio": 0.05,
                "max_steps": args.steps,
                "save_steps": max(args.steps // 3, 1),
                "routing_every": max(args.steps // 10, 1),
                "seed": args.seed,
                "device": "cpu",
                "logging_steps": 10,
            },
        }
    )


def score_pair(args: QuickstartArgs, adapter_dir: str) -> dict[str, dict[str, float]]:
    """Exact match per skill for base and candidate on the same held-out items."""
    from peft import PeftModel

    from moetune.demo.base import load_base
    from moetune.demo.evaluate import exact_match, scores_by_skill
    from moetune.demo.skills import base_skills, make_items

    items = make_items([*base_skills(), args.new_skill], args.eval_items, args.seed, "eval")
    model, tok = load_base()
    base = scores_by_skill(items, exact_match(model, tok, items))
    candidate_model = PeftModel.from_pretrained(model, adapter_dir)
    cand = scores_by_skill(items, exact_match(candidate_model, tok, items))
    return {name: {"base": base[name], "candidate": cand[name]} for name in base}


def run_quickstart(args: QuickstartArgs, progress: bool = True) -> dict[str, Any]:
    """Run the pipeline; returns the summary (also written to OUT/quickstart.json)."""
    from moetune.demo.skills import write_jsonl
    from moetune.train import train

    started = time.perf_counter()
    train_file = write_jsonl(args.out_dir / "data" / "train.jsonl", training_rows(args))
    result = train(run_config(args, train_file), progress=progress)
    scores = score_pair(args, result.adapter_dir)
    summary = {
        "adapter_dir": result.adapter_dir,
        "ledger": str(args.out_dir / "ledger.jsonl"),
        "coverage": result.coverage,
        "router_changed": result.router_changed,
        "steps": result.steps,
        "final_loss": result.final_loss,
        "new_skill": args.new_skill,
        "scores": scores,
        "peak_memory_bytes": result.peak_memory_bytes,
        "planned_peak_bytes": result.planned_peak_bytes,
        "seconds": round(time.perf_counter() - started, 1),
        "args": {k: str(v) for k, v in asdict(args).items()},
    }
    atomic_write_json(args.out_dir / "quickstart.json", summary)
    return summary
