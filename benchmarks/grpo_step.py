"""Where a GRPO step's time goes on the demo MoE: generation (the rollout's `generate`) vs
the rest (reward scoring, log-prob passes, forward/backward, optimizer).

    PYTHONPATH=src python benchmarks/grpo_step.py [--steps 12] [--completion 12 32]

Runs moetune's real `train()` (train.method grpo, the quickstart's settings: 4 prompts × 8
generations per step, LoRA on attention + experts, CPU fp32) and times every optimizer step
and every `generate` call inside it. The first step (warm-up) is left out of the means.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any

import bench_env
import trl
from transformers import GenerationMixin

from moetune.config import parse_config
from moetune.demo.base import MAX_LEN, SHIPPED_DIR
from moetune.demo.quickstart import prompt_rows
from moetune.demo.skills import stream, write_jsonl
from moetune.train import train


@contextmanager
def timed(steps: list[float], generation: list[float]):
    """Patch GRPOTrainer.training_step and generate to record their wall times."""
    real_step, real_generate = trl.GRPOTrainer.training_step, GenerationMixin.generate

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        generation.append(0.0)
        start = time.perf_counter()
        try:
            return real_step(self, *args, **kwargs)
        finally:
            steps.append(time.perf_counter() - start)

    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real_generate(self, *args, **kwargs)
        finally:
            generation[-1] += time.perf_counter() - start

    trl.GRPOTrainer.training_step, GenerationMixin.generate = step, generate  # type: ignore[method-assign]
    try:
        yield
    finally:
        trl.GRPOTrainer.training_step, GenerationMixin.generate = real_step, real_generate  # type: ignore[method-assign]


def config(root: Path, steps: int, completion: int, batch: int = 32) -> Any:
    rows = prompt_rows(list(islice(stream(["last"], 0, "train"), 400)))
    data = write_jsonl(root / "prompts.jsonl", rows)
    return parse_config(
        {
            "model": {"id": str(SHIPPED_DIR), "dtype": "float32"},
            "lora": {"rank": 8, "targets": ["attention", "experts"]},
            "data": {"train_file": str(data)},
            "output": {"dir": str(root / f"run-{completion}"), "ledger": str(root / "l.jsonl")},
            "train": {
                "method": "grpo", "seq_len": MAX_LEN, "batch_size": batch, "max_steps": steps,
                "gradient_checkpointing": False, "learning_rate": 2e-3, "device": "cpu",
                "save_steps": 1000, "routing_every": 0,
                "grpo": {"num_generations": 8, "max_completion_length": completion,
                         "beta": 0.04},
            },
        }
    )  # fmt: skip


def measure(steps: int, completion: int, batch: int = 32) -> dict[str, float]:
    step_s: list[float] = []
    gen_s: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, timed(step_s, gen_s):
        train(config(Path(tmp), steps, completion, batch), progress=False)
    step_mean = statistics.mean(step_s[1:])
    gen_mean = statistics.mean(gen_s[1:])
    return {
        "completion": completion,
        "step_s": step_mean,
        "generation_s": gen_mean,
        "training_s": step_mean - gen_mean,
        "generation_share": gen_mean / step_mean,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--completion", type=int, nargs="+", default=[12, 32])
    parser.add_argument("--smoke", action="store_true", help="2 steps of 1 prompt x 8 (seconds)")
    bench_env.add_argument(parser)
    opts = parser.parse_args()
    bench_env.apply()
    batch = 8 if opts.smoke else 32
    if opts.smoke:
        opts.steps, opts.completion = 2, [4]
    print(f"[{bench_env.describe()}]")
    print("| max_completion_length | step s | generation s | training s | generation share |")
    print("|---|---|---|---|---|")
    for completion in opts.completion:
        r = measure(opts.steps, completion, batch)
        print(
            f"| {completion} | {r['step_s']:.3f} | {r['generation_s']:.3f} | "
            f"{r['training_s']:.3f} | {r['generation_share']:.0%} |"
        )


if __name__ == "__main__":
    main()
