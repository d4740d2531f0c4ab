"""Numbers a run takes in must be numbers: a NaN or an Inf in an adapter's tensors is
refused wherever an adapter is loaded (export, eval, promote, resume), before anything is
written – merged weights full of NaN, or a gate scored on garbage, are worse than a stop.
"""

from __future__ import annotations

import math
from pathlib import Path

from moetune.errors import MoetuneError, clip

ADAPTER_WEIGHTS = "adapter_model.safetensors"


class NonFiniteError(MoetuneError):
    """A tensor or a number that should be finite holds NaN or Inf."""


def first_non_finite(path: Path) -> tuple[str, int] | None:
    """(tensor name, count of NaN/Inf values) of the first tensor of the safetensors file
    `path` that is not all finite; None when every one is – or when the file cannot be read
    at all (truncated, not safetensors), which the loader's own checks report."""
    # lazy: heavy to import (safetensors, torch)
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            for name in sorted(fh.keys()):
                tensor = fh.get_tensor(name)
                bad = int((~torch.isfinite(tensor)).sum()) if tensor.is_floating_point() else 0
                if bad:
                    return name, bad
    except (SafetensorError, OSError):
        return None
    return None


def require_finite_adapter(adapter_dir: Path) -> None:
    """NonFiniteError (exit 2) naming the tensor and the file when the adapter in
    `adapter_dir` holds a NaN or an Inf; a missing file is left to the caller's checks."""
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
