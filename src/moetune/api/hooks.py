"""moetune's routing and memory callbacks as ordinary `TrainerCallback`s for a trainer the
user builds: the same classes `moetune train` adds (train/callbacks.py, train/routing/)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.api.loading import SPEC
from moetune.engine.experts_lora import register
from moetune.errors import ConfigError
from moetune.train.callbacks import MetricsCallback
from moetune.train.routing.recorder import RoutingCallback, RoutingRecorder
from moetune.train.rundir.checkpoint import JsonlLog

if TYPE_CHECKING:
    from torch import nn
    from transformers import TrainerCallback


def callbacks(
    model: nn.Module, log_dir: str | Path | None = None, *, routing_every: int = 10
) -> list[TrainerCallback]:
    """[metrics, routing] for `trainer.add_callback` / `callbacks=`: a metrics row per log
    (loss, lr, tokens/s, memory; a NaN / Inf loss stops the run) and the expert load of
    every MoE layer each `routing_every` steps, warning when a layer collapses. Rows go to
    `log_dir`/metrics.jsonl and routing.jsonl, or stay in memory (each callback's `write`
    is then the list of its rows).
    `model`: one `moetune.load` returned (its spec says where the routers are)."""
    spec = model.__dict__.get(SPEC)
    if spec is None:
        raise ConfigError(
            "this model did not come from moetune.load, so its routers are not known",
            "load it with `model, tokenizer = moetune.load(...)`",
        )
    metrics = MetricsCallback(_sink(log_dir, "metrics.jsonl"))
    routing = RoutingCallback(
        RoutingRecorder(model, spec),
        routing_every,
        _sink(log_dir, "routing.jsonl"),
        lambda message: warnings.warn(message, stacklevel=2),
    )
    return [metrics, routing]


class _Rows(list[dict[str, Any]]):
    """Rows kept in memory when no log_dir is given."""

    def __call__(self, row: dict[str, Any]) -> None:
        self.append(row)


def _sink(log_dir: str | Path | None, name: str) -> Callable[[dict[str, Any]], None]:
    if log_dir is None:
        return _Rows()
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    return JsonlLog(Path(log_dir) / name).append


def register_experts() -> None:
    """Make `experts_implementation="moetune_lora"` loadable in your own script.

    Call it before `AutoModelForCausalLM.from_pretrained(..., experts_implementation=
    "moetune_lora")` (transformers checks the name at load); peft's LoRA on that model's
    fused experts (`LoraConfig(target_parameters=[...experts.gate_up_proj, ...down_proj])`)
    then trains on moetune's split-LoRA path, and the adapter stays a plain peft one.
    See docs/engine.md ("In your own script").
    """
    register()
