"""moetune as a library: the CLI's entry functions, typed, taking the same RunConfig
(docs/api.md). `moetune` forwards these names lazily, so `import moetune` stays cheap."""

from moetune.api.configure import run_config
from moetune.api.hooks import callbacks, register_experts
from moetune.api.loading import Loaded, load
from moetune.api.stages import (
    eval_run,
    export_run,
    gate_results,
    lint_run,
    plan_run,
    push_run,
    train_run,
)

__all__ = [
    "Loaded",
    "callbacks",
    "eval_run",
    "export_run",
    "gate_results",
    "lint_run",
    "load",
    "plan_run",
    "push_run",
    "register_experts",
    "run_config",
    "train_run",
]
