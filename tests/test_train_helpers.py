"""Builders shared by the test_train_* files (no tests here): a tiny Qwen3-MoE with the
demo's character tokenizer saved as a local model dir, generated JSONL rows, run configs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from moetune.config import RunConfig, parse_config

WORDS = ("abc", "hello", "xyz", "moe", "tune", "lora", "expert", "route", "gate", "token")
GEN_TEMPLATE = (  # a chat template whose assistant turns TRL can mask ({% generation %})
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}<eos>{% endgeneration %}"
    "{% else %}{{ m['content'] }}>{% endif %}{% endfor %}"
)


def save_tiny_model(
    out: Path,
    seed: int = 0,
    chat_template: str | None = None,
    dtype: str = "float32",
    **config_over: Any,
) -> Path:
    """Qwen3-MoE, hidden 16, 2 MoE layers, 4 experts, top-2 + the demo char tokenizer
    (`config_over`: other config fields, e.g. wider dims)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moetune.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    if chat_template:
        tok.chat_template = chat_template
    config = Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    for key, value in config_over.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def reverse_rows(n: int = 24) -> list[dict[str, str]]:
    return [{"prompt": f"rev:{w}>", "completion": w[::-1]} for w in (WORDS * n)[:n]]


def run_config(model: Path, data: Path, out: Path, **train: Any) -> RunConfig:
    """A short CPU fp32 run; `train` overrides train.* fields, `lora__x` lora.x (data__,
    model__ alike)."""
    lora, data_over, model_over = (
        {k.removeprefix(p): train.pop(k) for k in list(train) if k.startswith(p)}
        for p in ("lora__", "data__", "model__")
    )
    section = {
        "max_steps": 6,
        "batch_size": 2,
        "seq_len": 32,
        "learning_rate": 1e-2,
        "save_steps": 3,
        "routing_every": 2,
        "device": "cpu",
        **train,
    }
    return parse_config(
        {
            "model": {"id": str(model), **model_over},
            "lora": {"rank": 4, **lora},
            "data": {"train_file": str(data), **data_over},
            "output": {"dir": str(out), "ledger": str(out.parent / "ledger.jsonl")},
            "train": section,
        }
    )


def tiny_run(root: Path) -> Any:
    """A tiny saved model and 24 reverse rows under `root` (the multi-process tests' base)."""
    import types

    model = save_tiny_model(root / "model")
    data = write_jsonl(root / "train.jsonl", reverse_rows(24))
    return types.SimpleNamespace(root=root, model=model, data=data)


def tiny_cfg(tiny: Any, out: Path, **over: Any) -> RunConfig:
    """tiny_run's run config: 6 steps, a checkpoint every 2."""
    return run_config(tiny.model, tiny.data, out, **{"max_steps": 6, "save_steps": 2, **over})


@contextmanager
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread; 2 shared cores oversubscribe otherwise."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write_small_moe_config(out: Path) -> Path:
    """config.json of a small Qwen3-MoE (16 experts, hidden 64) for planner tests."""
    config = {
        "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "moe_intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 16, "num_experts_per_tok": 2, "max_position_embeddings": 512,
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    return out


def train_capturing(cfg: RunConfig) -> tuple[Any, Any]:
    """train(cfg) on one thread, and the TRL trainer it built (captured at build time)."""
    import pytest

    from moetune.train import train
    from moetune.train import trainer as trainer_mod

    built: dict[str, Any] = {}
    real = trainer_mod.build_trainer

    def spy(*args: Any, **kwargs: Any) -> Any:
        built["trainer"], routing = real(*args, **kwargs)
        return built["trainer"], routing

    with pytest.MonkeyPatch.context() as mp, one_thread():
        mp.setattr(trainer_mod, "build_trainer", spy)
        return train(cfg, progress=False), built["trainer"]


# the child's run line of slowed(): train the config given as its first argument
TRAIN_CONFIG = """from moetune.config import load_config
from moetune.train import train
train(load_config(sys.argv[1]), progress=False)"""


def slowed(run: str, trainer: str = "SFTTrainer", from_step: int = 2, pause: float = 0.5) -> str:
    """A child script whose `trainer` (a TRL class) sleeps `pause` s in each step from
    `from_step` on – leaving the parent time to act between checkpoints – then runs `run`."""
    return f"""
import sys, time, torch, trl

torch.set_num_threads(1)
cls = trl.{trainer}
real_step = cls.training_step

def slow_step(self, *args, **kwargs):  # leave the parent time to act between checkpoints
    if self.state.global_step >= {from_step}:
        time.sleep({pause})
    return real_step(self, *args, **kwargs)

cls.training_step = slow_step
{run}
"""


def wait_for(path: Path, proc: Any, log: Path, timeout: float = 180.0) -> None:
    """Until `path` exists; fails when the child `proc` died first (its `log`) or at timeout."""
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run died early: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"no {path} after {timeout:.0f} s"
        time.sleep(0.05)
