"""`moetune doctor`: what is installed, what is known to be broken, what the machine has."""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

# Libraries whose versions decide which traps exist (knowledge.md lists the ones seen).
TRACKED = ("torch", "transformers", "peft", "trl", "accelerate", "mlx-lm", "bitsandbytes")


@dataclass(frozen=True)
class KnownBad:
    """A version combination known to fail, with what happens and the fix."""

    when: str
    message: str
    fix: str

    def applies(self, versions: dict[str, str]) -> bool:
        return _CHECKS[self.when](versions)


def _ver(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _mlx_needs_tf5(v: dict[str, str]) -> bool:
    return "mlx-lm" in v and _ver(v["mlx-lm"]) >= (0, 30, 6) and _ver(v["transformers"]) < (5,)


def _tf513_breaks_mlx(v: dict[str, str]) -> bool:
    mlx = v.get("mlx-lm", "")
    return bool(mlx) and v.get("transformers") == "5.13.0" and _ver(mlx)[:2] == (0, 31)


def _old_peft(v: dict[str, str]) -> bool:
    return "peft" in v and _ver(v["peft"]) < (0, 17)


_CHECKS = {"mlx-tf5": _mlx_needs_tf5, "tf513-mlx031": _tf513_breaks_mlx, "old-peft": _old_peft}

KNOWN_BAD = (
    KnownBad(
        "mlx-tf5", "mlx-lm >= 0.30.6 needs transformers >= 5", "pip install 'transformers>=5'"
    ),
    KnownBad(
        "tf513-mlx031",
        "transformers 5.13.0 breaks `import mlx_lm` 0.31.x",
        "pip install 'transformers!=5.13.0'",
    ),
    KnownBad(
        "old-peft",
        "peft < 0.17 has no ParamWrapper: LoRA cannot reach fused experts",
        "pip install 'peft>=0.21.2'",
    ),
)


@dataclass
class DoctorReport:
    versions: dict[str, str]
    problems: list[dict[str, str]]
    hf_hub_disable_xet: str | None
    hf_hub_offline: str | None
    free_disk_bytes: int
    cache_dir: str
    accelerators: list[dict[str, object]] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def installed_versions() -> dict[str, str]:
    """Versions of the tracked libraries that are installed (absent ones are left out)."""
    found = {}
    for name in TRACKED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def accelerators() -> list[dict[str, object]]:
    """Visible CUDA devices (name, total bytes) and Apple MPS, if any."""
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
    problems = [{"message": kb.message, "fix": kb.fix} for kb in KNOWN_BAD if kb.applies(versions)]
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
    )
