"""`moetune doctor`: what is installed, what is known to be broken, what the machine has."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moetune.config import RunConfig
from moetune.io import unwritable
from moetune.lint.mlx_env import backend_fix, mlx_backend, pin_problems, version_tuple
from moetune.lint.registry import installed_versions
from moetune.plan.hardware import card_for_device, get_card

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
    torch: dict[str, object] = field(default_factory=dict)  # TorchBuild.to_json()
    card: dict[str, object] | None = None  # card_here() of the config given, if any
    # mlx-lm's stack: versions and the device mlx computes on (None: no backend; why)
    mlx: dict[str, str | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class TorchBuild:
    """The installed torch as a run sees it: the CUDA (or ROCm) it was built for and the
    devices it can use here."""

    version: str
    cuda: str | None  # torch.version.cuda: None for a CPU-only (or ROCm) build
    hip: str | None  # torch.version.hip: the ROCm build's HIP version
    cuda_available: bool  # a CUDA (or ROCm) device torch can use now
    mps_available: bool

    @property
    def label(self) -> str:
        """ "CUDA 12.8", "ROCm 6.3" or "CPU-only", and "+ MPS" where Metal is usable."""
        kind = f"CUDA {self.cuda}" if self.cuda else f"ROCm {self.hip}" if self.hip else "CPU-only"
        return f"{kind} + MPS" if self.mps_available else kind

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "label": self.label}


def torch_build() -> TorchBuild:
    """What the installed torch was built for and sees now."""
    # lazy: heavy to import (torch)
    import torch

    mps = getattr(torch.backends, "mps", None)
    return TorchBuild(
        version=str(torch.__version__),
        cuda=torch.version.cuda,
        hip=getattr(torch.version, "hip", None),
        cuda_available=torch.cuda.is_available(),
        mps_available=bool(mps is not None and mps.is_available()),
    )


def no_cuda_here(build: TorchBuild) -> str | None:
    """Why this host cannot run a CUDA card's training (None: it can)."""
    if build.cuda is None and build.hip is None:
        return f"the installed torch {build.version} is a CPU-only build"
    if not build.cuda_available:
        return f"torch {build.version} ({build.label}) sees no CUDA device here"
    return None


def why_not_here(cfg: RunConfig, build: TorchBuild) -> str | None:
    """Why this host cannot train on the card `cfg` names (CARD-NOT-HERE's cause), or None:
    no such card, train.device cpu (on purpose), or CUDA here. (A lane sending it to a pod is
    the caller's to know: its Site, filled from the provider's traits.)"""
    card = get_card(cfg.hardware.card) if cfg.hardware.card else None
    if card is None or card.is_host or cfg.train.device == "cpu":
        return None
    if card.kind == "mps":  # an Apple card: Metal through torch's MPS backend
        return None if build.mps_available else f"torch {build.version} has no MPS device here"
    return no_cuda_here(build)


def card_here(cfg: RunConfig, build: TorchBuild, remote: bool = False) -> dict[str, object]:
    """The card the config names, and whether this host can train on it (CARD-NOT-HERE's
    verdict): "here", "cpu" (train.device cpu), "pod" (a lane sends it elsewhere), or why not."""
    card = get_card(cfg.hardware.card) if cfg.hardware.card else None
    if card is None:
        return {"card": None, "verdict": "no hardware.card: `moetune plan` plans the catalog"}
    if cfg.train.device == "cpu":
        verdict = "train.device cpu: trained here on the CPU, the card is planned only"
    elif remote:  # the provider's trait (Site.remote): plan/ and lint/ know no provider
        verdict = f"the pod's (lane.provider {cfg.lane.provider}), not this host's"
    else:
        why = why_not_here(cfg, build)
        verdict = f"not here: {why}" if why else "here"
    return {"card": card.id, "name": card.name, "compute_dtype": card.compute_dtype,
            "verdict": verdict}  # fmt: skip


def accelerators() -> list[dict[str, object]]:
    """Visible CUDA devices (name, total bytes) and Apple MPS, if any."""
    # lazy: heavy to import (torch)
    import torch

    devices: list[dict[str, object]] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append(
                {
                    "kind": "cuda",
                    "name": props.name,
                    "bytes": props.total_memory,
                    "card": card_for_device(props.name),
                }
            )
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append({"kind": "mps", "name": "Apple GPU", "bytes": None})
    return devices


def hf_cache_dir() -> Path:
    home = os.environ.get("HF_HOME") or os.path.join(Path.home(), ".cache", "huggingface")
    return Path(home)


def run_doctor(cfg: RunConfig | None = None, remote: bool = False) -> DoctorReport:
    """Collect the report (with `cfg`: its card and whether this host trains on it, unless
    `remote`: its lane sends it to a pod); never raises for a missing optional library."""
    build = torch_build()
    versions = installed_versions()
    problems = known_bad(versions)
    cache = hf_cache_dir()
    if (why := unwritable(cache)) is not None:  # HOME read-only: hub downloads would fail
        problems.append({"message": f"the Hugging Face cache {cache} cannot be written ({why})",
                         "fix": "set HF_HOME to a writable dir (local bases and data files "
                                "need none)"})  # fmt: skip
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
        torch=build.to_json(),
        card=card_here(cfg, build, remote) if cfg is not None else None,
    )
