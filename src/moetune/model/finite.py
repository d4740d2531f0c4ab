"""Numbers a run takes in must be numbers: a NaN or an Inf in an adapter's tensors is
refused wherever an adapter is loaded (export, eval, promote, resume), before anything is
written – merged weights full of NaN, or a gate scored on garbage, are worse than a stop.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from moetune.errors import MoetuneError, clip

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


class NonFiniteError(MoetuneError):
    """A tensor or a number that should be finite holds NaN or Inf."""


def first_non_finite(path: Path) -> tuple[str, int] | None:
    """(tensor name, count of NaN/Inf values) of the first tensor of the safetensors file
    `path` that is not all finite; None when every one is – or when the file cannot be read
    at all (truncated, not safetensors), which the loader's own checks report."""
    # lazy: heavy to import (safetensors)
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            return first_non_finite_of((name, fh.get_tensor(name)) for name in sorted(fh.keys()))
    except (SafetensorError, OSError):
        return None


def first_non_finite_of(named: Iterable[tuple[str, Any]]) -> tuple[str, int] | None:
    """(name, count of NaN/Inf values) of the first floating-point tensor of `named` that
    is not all finite (integer tensors hold no NaN); None when every one is."""
    # lazy: heavy to import (torch)
    import torch

    for name, tensor in named:
        bad = int((~torch.isfinite(tensor)).sum()) if tensor.is_floating_point() else 0
        if bad:
            return name, bad
    return None


class AdapterConfigError(MoetuneError):
    """An adapter_config.json peft cannot load an adapter from."""


def _config_problem(config: Any) -> str | None:
    if not isinstance(config, dict):
        return f"is a JSON {type(config).__name__}, not an object"
    if not isinstance(config.get("peft_type"), str) or not config["peft_type"]:
        return "names no peft_type (empty or truncated)"
    if config["peft_type"] == "LORA" and not (
        config.get("target_modules") or config.get("target_parameters")
    ):
        return "names no target_modules or target_parameters (the adapter would change nothing)"
    return None


def require_adapter_config(adapter_dir: Path) -> None:
    """AdapterConfigError (exit 2) when `adapter_dir`'s adapter_config.json is not one peft
    loads from – checked before any model is built (peft's own error was a bare KeyError
    after the base had been scored); a missing file is left to the caller's checks."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        return
    try:
        problem = _config_problem(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        problem = f"cannot be read as JSON ({clip(err, 80)})"
    if problem:
        raise AdapterConfigError(
            f"{clip(path, 100)} {problem}",
            "point at an adapter dir written by peft's save_pretrained (or `moetune train`)",
        )


def require_finite_adapter(adapter_dir: Path) -> None:
    """NonFiniteError (exit 2) naming the tensor and the file when the adapter in
    `adapter_dir` holds a NaN or an Inf (AdapterConfigError when its config is not one peft
    reads); a missing file is left to the caller's checks."""
    require_adapter_config(adapter_dir)
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        return
    found = first_non_finite(path)
    if found is not None:
        name, bad = found
        raise NonFiniteError(
            f"{clip(path, 100)}: tensor {clip(name, 100)} holds {bad} NaN/Inf value(s)",
            "the training that wrote it diverged: retrain (lower train.learning_rate), or "
            "use an earlier checkpoint's adapter",
        )


def require_finite(value: float, what: str, fix: str) -> float:
    """`value` when it is a finite number, else NonFiniteError naming `what`."""
    if not math.isfinite(value):
        raise NonFiniteError(f"{what} is {value}", fix)
    return value
