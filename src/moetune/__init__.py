"""moetune: fine-tune Mixture-of-Experts LLMs on limited GPU memory, first time right.

The Python API (docs/api.md) is forwarded from moetune.api on first use, so `import
moetune` loads neither torch nor transformers:

    import moetune
    model, tokenizer = moetune.load("run.yaml")  # planned, LoRA attached and audited
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# the public names, each from moetune.api (docs/api.md lists them; tests/test_api.py checks)
__all__ = [
    "Loaded",
    "RunConfig",
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

if TYPE_CHECKING:
    from moetune.api import (
        Loaded,
        callbacks,
        eval_run,
        export_run,
        gate_results,
        lint_run,
        load,
        plan_run,
        push_run,
        register_experts,
        run_config,
        train_run,
    )
    from moetune.config import RunConfig


def __getattr__(name: str) -> Any:
    """A public name, imported on first use: moetune.api loads torch and transformers."""
    if name == "RunConfig":
        return importlib.import_module("moetune.config").RunConfig
    if name in __all__:
        return getattr(importlib.import_module("moetune.api"), name)
    raise AttributeError(f"module 'moetune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
