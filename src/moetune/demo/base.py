"""Pretrain, save and load the demo's tiny Qwen3-MoE base.

The shipped base in `base_model/` was produced by this module with:

    python -m moetune.demo.base --out src/moetune/demo/base_model --seed 0 --steps 3000 --threads 2

(2 torch threads). It is a ~1.4 M-parameter Qwen3-MoE (3 layers, hidden 128, 8 experts,
top-2, tied embeddings) trained from scratch on the base skills with a plain torch loop;
`meta.json` records the seed, steps, per-skill held-out scores and library versions.
Loading it needs neither the network nor a cache. `build_base()` without `out_dir`
rebuilds into the user cache (`~/.cache/moetune/demo-base`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.utils import logging as hf_logging

from moetune.demo.evaluate import skill_scores
from moetune.demo.skills import Item, base_skills, new_skills, stream
from moetune.demo.tokenizer import build_tokenizer, load_tokenizer, save_tokenizer

SHIPPED_DIR = Path(__file__).parent / "base_model"
MAX_LEN = 32  # longest demo row (`copy:` + 8 letters + `>` + 8 letters + EOS) is 23 tokens
EVAL_N = 200  # held-out items per skill for the scores in meta.json
IGNORE = -100  # label value the loss skips (prompt and padding)


@dataclass(frozen=True)
class Arch:
    """Shape of the demo model (docs/knowledge.md §11: depth and steps matter more than width)."""

    layers: int = 3
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    experts: int = 8
    top_k: int = 2
    expert_ffn: int = 128


@dataclass(frozen=True)
class Pretrain:
    seed: int = 0
    steps: int = 3000
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    aux_loss_coef: float = 0.01  # keeps expert load balanced while learning from scratch
    skills: tuple[str, ...] = field(default_factory=lambda: tuple(base_skills()))


def cache_dir() -> Path:
    """Where a user rebuild goes: `$XDG_CACHE_HOME/moetune/demo-base` (default ~/.cache)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "moetune" / "demo-base"


def model_config(
    tok: PreTrainedTokenizerFast, arch: Arch = Arch(), aux_loss_coef: float = 0.01
) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=arch.hidden,
        intermediate_size=arch.expert_ffn,  # unused: every layer is MoE
        moe_intermediate_size=arch.expert_ffn,
        num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads,
        num_experts=arch.experts,
        num_experts_per_tok=arch.top_k,
        norm_topk_prob=True,
        router_aux_loss_coef=aux_loss_coef,
        max_position_embeddings=MAX_LEN * 2,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )


def collate(items: Sequence[Item], tok: PreTrainedTokenizerFast) -> dict[str, torch.Tensor]:
    """Right-padded batch; loss only on answer + EOS (the prompt's letters are random)."""
    rows, labels = [], []
    for it in items:
        p = tok(it.prompt, add_special_tokens=False)["input_ids"]
        a = [*tok(it.answer, add_special_tokens=False)["input_ids"], tok.eos_token_id]
        rows.append(p + a)
        labels.append([IGNORE] * len(p) + a)
    width = max(map(len, rows))
    pad = [int(tok.pad_token_id)]
    return {
        "input_ids": torch.tensor([r + pad * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([r + [IGNORE] * (width - len(r)) for r in labels]),
    }


def lr_schedule(warmup: int, steps: int) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to 10 % of the peak."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]pretraining demo base"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps · loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=not enabled,
    )


def pretrain(
    model: Qwen3MoeForCausalLM, tok: PreTrainedTokenizerFast, args: Pretrain, progress: bool
) -> list[float]:
    """moetune's own small loop: fresh generated batches, AdamW, warmup + cosine."""
    torch.manual_seed(args.seed)
    data = stream(args.skills, args.seed, split="train")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(args.warmup, args.steps))
    model.train()
    losses: list[float] = []
    with _progress(progress) as bar:
        task = bar.add_task("pretrain", total=args.steps, loss=float("nan"))
        for _ in range(args.steps):
            batch = collate([next(data) for _ in range(args.batch_size)], tok)
            loss = model(**batch, output_router_logits=True).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.update(task, advance=1, loss=sum(losses[-50:]) / len(losses[-50:]))
    return losses


def versions() -> dict[str, str]:
    # lazy: heavy to import (peft)
    import peft

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "peft": peft.__version__,
    }


def _save(model: Any, tok: PreTrainedTokenizerFast, out: Path, dtype: torch.dtype) -> None:
    with _quiet():
        model.to(dtype).save_pretrained(str(out))
    save_tokenizer(tok, out)
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; shipped package data must be world-readable


def _swap_in(tmp: Path, out: Path) -> None:
    """Replace `out` with the finished `tmp`, so `out` is never half-written."""
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


@contextmanager
def _quiet() -> Iterator[None]:
    """Hide transformers' per-shard tqdm bars; the demo has one file and its own progress."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def build_base(
    out_dir: str | Path | None = None,
    seed: int = 0,
    steps: int = 3000,
    progress: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    eval_n: int = EVAL_N,
) -> dict[str, Any]:
    """Pretrain the demo base, save it (weights in `dtype`) and return its meta.json content.

    Default `out_dir` is the user cache (`cache_dir()`). Scores in the meta are measured
    on held-out items after reloading the saved files, so they describe exactly what
    `load_base` returns.
    """
    out = Path(out_dir) if out_dir is not None else cache_dir()
    args, started = Pretrain(seed=seed, steps=steps), time.time()
    tok = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(model_config(tok, aux_loss_coef=args.aux_loss_coef))
    losses = pretrain(model, tok, args, progress)
    meta = {"command": build_command(out, seed, steps), **_meta(args, model, losses, started)}
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _save(model, tok, tmp, dtype)
    loaded, _ = load_base(tmp)
    meta["scores"] = skill_scores(loaded, tok, [*base_skills(), *new_skills()], eval_n, seed)
    meta["eval"]["items_per_skill"] = eval_n
    meta["dtype"] = str(dtype).removeprefix("torch.")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    _swap_in(tmp, out)
    return meta


def _meta(args: Pretrain, model: Any, losses: list[float], started: float) -> dict[str, Any]:
    tail = losses[-100:]
    return {
        "seed": args.seed,
        "steps": args.steps,
        "pretrain": {k: v for k, v in asdict(args).items() if k not in ("seed", "steps")},
        "arch": asdict(Arch()),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": round(sum(tail) / len(tail), 4),
        "train_seconds": round(time.time() - started, 1),
        "torch_threads": torch.get_num_threads(),
        "eval": {"items_per_skill": EVAL_N, "split": "eval", "metric": "greedy exact match"},
        "base_skills": base_skills(),
        "new_skills": new_skills(),
        "versions": versions(),
    }


def build_command(out: Path, seed: int, steps: int) -> str:
    """The shell command that reproduces a build (recorded in meta.json)."""
    threads = torch.get_num_threads()
    if out.is_absolute() and out.is_relative_to(Path.cwd()):
        out = out.relative_to(Path.cwd())
    flags = f"--out {out} --seed {seed} --steps {steps} --threads {threads}"
    return f"python -m moetune.demo.base {flags}"


def load_base(
    path: str | Path | None = None, dtype: torch.dtype = torch.float32
) -> tuple[Qwen3MoeForCausalLM, PreTrainedTokenizerFast]:
    """Load a demo base (default: the one shipped in the package) from local files only.

    Weights are upcast to `dtype` (fp32 by default: CPU training is fastest and exact there).
    """
    src = Path(path) if path is not None else SHIPPED_DIR
    with _quiet():
        model = Qwen3MoeForCausalLM.from_pretrained(str(src), dtype=dtype, local_files_only=True)
    model.eval()
    return model, load_tokenizer(src)


def load_meta(path: str | Path | None = None) -> dict[str, Any]:
    src = Path(path) if path is not None else SHIPPED_DIR
    meta: dict[str, Any] = json.loads((src / "meta.json").read_text())
    return meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Pretrain the moetune demo base.")
    parser.add_argument("--out", type=Path, default=None, help=f"default: {cache_dir()}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=Pretrain.steps)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    opts = parser.parse_args(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    meta = build_base(opts.out, seed=opts.seed, steps=opts.steps)
    print(json.dumps(meta["scores"], indent=2))


if __name__ == "__main__":
    main()
