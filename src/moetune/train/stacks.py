"""Training stacks by `lora.stack`, each registered here as "module:function" so its
libraries load only when a run uses it: peft/TRL is trainer.py's own `_train`, mlx-lm
train/mlx/stack.py's `train_mlx`.

A stack's trainer takes (cfg, resume, allow_errors, (overwrite, overwrite_promoted),
progress) and returns a TrainResult; `train()` wraps every stack in the same ledger row and
run-dir lock. ("lane" is the remote run, moetune.lane – never a training stack.)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from moetune.registry import Registry

STACKS: Registry[str] = Registry("training stack")
STACKS.add("peft", "moetune.train.trainer:_train")
STACKS.add("mlx", "moetune.train.mlx.stack:train_mlx")


def register_stack(stack: str, target: str) -> None:
    """Train `lora.stack: <stack>` with the function `target` ("package.module:function")."""
    STACKS.add(stack, target)


def stack_trainer(stack: str) -> Callable[..., Any]:
    """The trainer registered for `stack`."""
    module, _, name = STACKS.get(stack).partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn
