"""`moetune doctor`: what is installed, what is known to be broken, what the machine has."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moetune.lint.mlx_env import backend_fix, mlx_backend, pin_problems, version_tuple
from moetune.lint.registry import installed_versions

PEFT_MIN = (0, 17)  # ParamWrapper (LoRA on fused expert parameters) arrived in peft 0.17


def known_bad(versions: Mapping[str, str]) -> list[dict[str, str]]:
    """Known-bad combinations among `versions`: the mlx pins (shared with the
    MLX-TRANSFORMERS-PIN rule) and a peft too old to reach fused experts."""
    problems = [{"message": t.message, "fix": t.fix} for t in pin_problems(versions)]
    if "mlx-lm" in versions and mlx_backend().backend is None:  # MLX-NO-BACKEND's trap
        message = f"mlx-lm {versions['mlx-lm']} has no mlx backend ({mlx_backend().error})"
        problems.append({"message": message, "fix": backend_fix()})
    if "peft" in versions and version_tuple(versions["peft"]) < PEFT_MIN:
        problems.append(
            {
                "message": "peft < 0.17 has no ParamWrapper: LoRA cannot reach fused experts",
                "fix": "pip install 'peft>=0.21.2'",
            }
        )
    return problems


@dataclass
class DoctorReport:
    versions: dict[str, str]
    problems: list[dict[str, str]]
    hf_hub_disable_xet: str | None
    hf_hub_offline: str | None
    free_disk_bytes: int
    cache_dir: str
    accelerators: list[dict[str, object]] = field(default_factory=list)
    # mlx-lm's stack: versions and the device mlx computes on (None: no backend; why)
    mlx: dict[str, str | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def accelerators() -> list[dict[str, object]]:
    """Visible CUDA devices (name, total bytes) and Apple MPS, if any."""
    # lazy: heavy to import (torch)
    import torch

    devices: list[dict[str, object]] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append({"kind": "cuda", "name": props.name, "bytes": props.total_memory})
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append({"kind": "mps", "name": "Apple GPU", "bytes": None})
    return devices


def hf_cache_dir() -> Path:
    home = os.environ.get("HF_HOME") or os.path.join(Path.home(), ".cache", "huggingface")
    return Path(home)


def run_doctor() -> DoctorReport:
    """Collect the report; never raises for a missing optional library."""
    versions = installed_versions()
    problems = known_bad(versions)
    cache = hf_cache_dir()
    probe = cache if cache.exists() else Path.home()
    return DoctorReport(
        versions=versions,
        problems=problems,
        hf_hub_disable_xet=os.environ.get("HF_HUB_DISABLE_XET"),
        hf_hub_offline=os.environ.get("HF_HUB_OFFLINE"),
        free_disk_bytes=shutil.disk_usage(probe).free,
        cache_dir=str(cache),
        accelerators=accelerators(),
        mlx=mlx_backend().to_json(),
    )
