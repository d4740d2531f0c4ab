"""GM-1: dense vs MoE at matched active compute, trained from scratch on CPU.

Every arm of a seed trains on the same rows in the same order (the corpus depends on the
seed only) for the same number of tokens, from a seed-fixed initialisation, with
moetune's own small loop (AdamW, warmup + cosine, clip 1.0). Held-out cross-entropy is
measured at init and `evals` times during training on one fixed held-out set; routing
health is read from the router logits of the final held-out pass. `run_bench` returns
plain JSON-able results; `summary.py` aggregates them over seeds.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from moetune.bench.arms import (
    DEFAULT_ARMS,
    DEFAULT_SIZE,
    BenchError,
    Built,
    get_arms,
    get_size,
    size_arms,
)
from moetune.bench.corpus import heldout_rows, token_rows
from moetune.bench.stats import routing_health
from moetune.demo.base import lr_schedule
from moetune.model import build_model

OnStep = Callable[[str, int], None]  # (arm name, seed) after every optimizer step


MAX_SEEDS = 100  # an interval is tight long before this
MAX_STEPS = 1_000_000  # 250 × the large size's budget: days of CPU


class BenchConfig(BaseModel):
    """What one `moetune bench gm1` runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size: str = Field(DEFAULT_SIZE, description="Bench size (tiny, small, medium, large).")
    seeds: int = Field(3, description="Seeds per arm (0 .. seeds-1); 2+ for an interval.")
    steps: int | None = Field(None, description="Optimizer steps per run (default: size's).")
    tokens: int | None = Field(None, description="Training tokens per run instead of steps.")
    arms: tuple[str, ...] = Field(DEFAULT_ARMS, description="Arms to train (dense always).")

    def resolved_steps(self) -> int:
        size = get_size(self.size)
        if self.steps is not None and self.tokens is not None:
            raise BenchError("--steps and --tokens both given", "pass only one of them")
        if self.tokens is not None:
            steps = math.ceil(self.tokens / (size.batch * size.seq))
        else:
            steps = size.steps if self.steps is None else self.steps
        if steps < 1:
            raise BenchError(f"a budget of {steps} steps trains nothing", "pass --steps >= 1")
        if steps > MAX_STEPS:  # 10**29 was accepted and ran until killed
            cause = f"a budget of {steps:.3g} steps per run is more than a CPU bench can finish"
            raise BenchError(cause, f"pass --steps (or --tokens) for at most {MAX_STEPS:,} steps")
        return steps

    def validated(self) -> BenchConfig:
        if self.seeds < 1:
            raise BenchError(f"--seeds {self.seeds}: at least one seed", "pass --seeds >= 1")
        if self.seeds > MAX_SEEDS:
            cause = f"--seeds {self.seeds:.3g}: more seeds than an interval needs"
            raise BenchError(cause, f"pass --seeds <= {MAX_SEEDS}")
        get_size(self.size), get_arms(list(self.arms)), self.resolved_steps()
        return self


@dataclass
class RunResult:
    """One arm trained with one seed."""

    arm: str
    seed: int
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out CE)
    train_loss: list[float] = field(default_factory=list)  # CE per step (aux excluded)
    train_s: float = 0.0
    tokens: int = 0
    routing: list[dict[str, Any]] = field(default_factory=list)

    @property
    def init_ce(self) -> float:
        return self.curve[0][1]

    @property
    def final_ce(self) -> float:
        return self.curve[-1][1]

    def to_json(self) -> dict[str, Any]:
        return {
            "arm": self.arm, "seed": self.seed, "init_ce": round(self.init_ce, 5),
            "final_ce": round(self.final_ce, 5), "tokens": self.tokens,
            "train_s": round(self.train_s, 2),
            "tokens_per_s": round(self.tokens / self.train_s, 1) if self.train_s else None,
            "curve": [[s, round(c, 5)] for s, c in self.curve],
            "train_loss": [round(v, 4) for v in self.train_loss], "routing": self.routing,
        }  # fmt: skip


def evaluate(model: Any, rows: torch.Tensor, batch: int, top_k: int) -> tuple[float, list[Any]]:
    """(token-mean CE over `rows`, per-layer routing loads – empty for a dense model)."""
    model.eval()
    total, count, logits_by_layer = 0.0, 0, list[list[torch.Tensor]]()
    with torch.no_grad():
        for i in range(0, rows.shape[0], batch):
            x = rows[i : i + batch]
            out = model(input_ids=x, output_router_logits=bool(top_k))
            logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1]).float()
            total += F.cross_entropy(logits, x[:, 1:].reshape(-1), reduction="sum").item()
            count += x[:, 1:].numel()
            for layer, r in enumerate(getattr(out, "router_logits", None) or ()):
                if len(logits_by_layer) <= layer:
                    logits_by_layer.append([])
                logits_by_layer[layer].append(r.detach())
    model.train()
    loads = routing_health([torch.cat(p) for p in logits_by_layer], top_k) if top_k else []
    return total / count, loads


def eval_steps(steps: int, evals: int) -> set[int]:
    """Steps after which the held-out set is measured: init (0), evenly spaced, the last."""
    return {0, steps, *(round(steps * (i + 1) / evals) for i in range(max(0, evals)))}


def train_run(
    built: Built, seed: int, train: torch.Tensor, held: torch.Tensor, size: Any, on_step: OnStep
) -> RunResult:
    """Train one arm from scratch on `train` [steps*batch, seq]; measure held-out CE."""
    steps, top_k, aux = train.shape[0] // size.batch, built.arm.top_k, built.arm.aux_coef
    torch.manual_seed(seed)
    model = build_model(built.spec, device="cpu", dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=size.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(max(1, steps // 10), steps))
    result, marks = RunResult(built.arm.name, seed), eval_steps(steps, size.evals)
    result.curve.append((0, evaluate(model, held, size.batch, top_k)[0]))
    model.train()
    for step in range(1, steps + 1):
        started = time.perf_counter()
        x = train[(step - 1) * size.batch : step * size.batch]
        out = model(input_ids=x, labels=x, output_router_logits=aux > 0)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        result.train_s += time.perf_counter() - started
        ce = out.loss.item() - (aux * out.aux_loss.item() if aux > 0 else 0.0)
        result.train_loss.append(ce)
        result.tokens += x.numel()
        if step in marks:
            ce_held, loads = evaluate(model, held, size.batch, top_k)
            result.curve.append((step, ce_held))
            result.routing = [load.to_json() for load in loads]
        on_step(built.arm.name, seed)
    return result


def machine() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "platform": platform.platform(),
        "processor": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average_at_start": [round(v, 2) for v in load],
    }


def run_bench(config: BenchConfig, on_step: OnStep = lambda arm, seed: None) -> dict[str, Any]:
    """Train every arm × seed of `config`; the raw results (see summary.summarize)."""
    config.validated()
    size, steps = get_size(config.size), config.resolved_steps()
    arms = get_arms(list(config.arms))
    built = size_arms(size, arms)
    started, cpu = time.time(), time.process_time()
    date = datetime.now(UTC).isoformat(timespec="seconds")
    held = heldout_rows(size.eval_rows, size.seq)
    runs: list[RunResult] = []
    for seed in range(config.seeds):
        train = token_rows(seed, "train", steps * size.batch, size.seq)  # same for each arm
        runs += [train_run(built[a.name], seed, train, held, size, on_step) for a in arms]
    return {
        "bench": "gm1", "date": date, "machine": machine(),
        "config": {**config.model_dump(), "steps": steps, "size_spec": size.model_dump(),
                   "tokens_per_run": steps * size.batch * size.seq,
                   "heldout_tokens": held.numel()},
        "models": {name: b.to_json(built["dense"]) for name, b in built.items()},
        "runs": [r.to_json() for r in runs], "wall_s": round(time.time() - started, 1),
        "cpu_s": round(time.process_time() - cpu, 1),
    }  # fmt: skip
