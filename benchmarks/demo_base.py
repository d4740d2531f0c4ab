"""LoRA on the demo base: how fast a new skill is learned and what it costs the old ones.

Runs TRL's SFTTrainer with a peft LoRA on attention + experts (r=8, dropout 0,
`target_parameters` on the fused expert stacks) and scores every skill by greedy exact
match on held-out items every `--eval-every` steps. Training seconds exclude evaluation.

    python benchmarks/demo_base.py mixed --skill last --steps 600 --lr 1e-3
    python benchmarks/demo_base.py overfit --skill last --rows 30 --steps 300 --lr 2e-2
    python benchmarks/demo_base.py mixed --smoke     # 2 steps: the script still runs

`mixed`: half the rows are the new skill, half spread over the base skills.
`overfit`: a tiny pack of only the new skill, repeated for many epochs.
Prints one JSON object (timeline of scores) and writes it to `--json` if given.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_env
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import SFTConfig, SFTTrainer

from moetune.demo.base import load_base
from moetune.demo.evaluate import skill_scores
from moetune.demo.skills import base_skills, make_items, to_prompt_completion

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def lora_config(r: int = 8) -> LoraConfig:
    # dropout must be 0: peft's ParamWrapper (expert stacks) refuses anything else
    return LoraConfig(
        r=r,
        lora_alpha=2 * r,
        lora_dropout=0.0,
        target_modules=ATTENTION,
        target_parameters=EXPERTS,
        task_type="CAUSAL_LM",
    )


def rows(mode: str, skill: str, n: int, seed: int) -> list[dict[str, str]]:
    """Training rows from the train split only, so the held-out scores stay honest."""
    if mode == "overfit":
        return to_prompt_completion(make_items([skill], n, seed, split="train"))
    old = base_skills()
    new = make_items([skill], n // 2, seed, split="train")
    replay = make_items(old, max(1, n // 2 // len(old)), seed, split="train")
    return to_prompt_completion(new + replay)  # the trainer shuffles


class Timeline(TrainerCallback):
    """Scores all skills every `every` steps; evaluation time is kept off the training clock."""

    def __init__(self, tok: Any, skills: list[str], every: int, n: int, seed: int) -> None:
        self.tok, self.skills, self.every, self.n, self.seed = tok, skills, every, n, seed
        self.points: list[dict[str, Any]] = []
        self.train_s = 0.0
        self.mark = time.time()

    def record(self, model: Any, step: int) -> None:
        t0 = time.time()
        self.train_s += t0 - self.mark
        scores = skill_scores(model, self.tok, self.skills, self.n, self.seed)
        point = {
            "step": step,
            "train_s": round(self.train_s, 1),
            "eval_s": round(time.time() - t0, 1),
        }
        self.points.append(point | {"scores": scores})
        print(json.dumps(self.points[-1]), flush=True)
        self.mark = time.time()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.train_s, self.mark = 0.0, time.time()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self.record(kw["model"], state.global_step)


def run(opts: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(opts.seed)
    model, tok = load_base(opts.base)
    data = Dataset.from_list(rows(opts.mode, opts.skill, opts.rows, opts.seed))
    timeline = Timeline(tok, [opts.skill, *base_skills()], opts.eval_every, opts.eval_n, 0)
    with tempfile.TemporaryDirectory() as out:
        trainer = SFTTrainer(
            model=model,
            args=sft_args(opts, out),
            train_dataset=data,
            processing_class=tok,
            peft_config=lora_config(opts.r),
            callbacks=[timeline],
        )
        timeline.mark = time.time()  # the step-0 point costs no training time
        timeline.record(trainer.model, 0)
        trainer.train()
    return {"options": vars(opts), "timeline": timeline.points}


def sft_args(opts: argparse.Namespace, out: str) -> SFTConfig:
    return SFTConfig(
        output_dir=out,
        max_steps=opts.steps,
        per_device_train_batch_size=opts.batch_size,
        learning_rate=opts.lr,
        lr_scheduler_type="constant",  # a learning curve independent of the run length
        warmup_steps=0,
        weight_decay=0.0,
        seed=opts.seed,
        max_length=64,
        logging_steps=max(1, opts.steps // 10),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        # TRL's SFTConfig defaults to bf16=True and gradient checkpointing even on CPU:
        # bf16 autocast makes this CPU ~3x slower and checkpointing only costs time here
        bf16=False,
        gradient_checkpointing=False,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=["mixed", "overfit"])
    p.add_argument("--skill", default="last")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rows", type=int, default=None, help="default: steps x batch (mixed), 30")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-n", type=int, default=100, help="held-out items per skill")
    p.add_argument("--seed", type=int, default=0)
    bench_env.add_argument(p)
    p.add_argument("--base", type=Path, default=None, help="default: the shipped base")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="2 steps, 4 rows, 2 items (seconds)")
    opts = p.parse_args()
    if opts.smoke:
        opts.steps, opts.rows, opts.batch_size, opts.eval_every, opts.eval_n = 2, 4, 2, 2, 2
    if opts.rows is None:
        opts.rows = 30 if opts.mode == "overfit" else opts.steps * opts.batch_size
    bench_env.apply()
    result = run(opts)
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
