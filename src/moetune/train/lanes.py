"""Training stacks by `lora.stack`: peft/TRL is trainer.py's own `_train`; others register
here as "module:function" so their libraries load only when a run uses them.

A lane takes (cfg, resume, allow_errors, (overwrite, overwrite_promoted), progress) and
returns a TrainResult; `train()` wraps every lane in the same ledger row and run-dir lock.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

LANES: dict[str, str] = {"mlx": "moetune.train.mlx_lane:train_mlx"}


def register_lane(stack: str, target: str) -> None:
    """Train `lora.stack: <stack>` with the function `target` ("package.module:function")."""
    LANES[stack] = target


def lane_for(stack: str, default: Callable[..., Any]) -> Callable[..., Any]:
    """The lane registered for `stack`, else `default` (the peft trainer)."""
    target = LANES.get(stack)
    if target is None:
        return default
    module, _, name = target.partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn
