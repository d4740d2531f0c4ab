"""This host as a card ("cpu"): its RAM, matmul throughput, memory and disk bandwidth.

The figures come from `host.json` in moetune's config dir (`$MOETUNE_HOST_FILE`, else
`$XDG_CONFIG_HOME/moetune/host.json`, else `~/.config/moetune/host.json`): written by
`moetune doctor --calibrate`, or by hand with the same fields (`HostProfile`). With no
file the card has this machine's RAM and `DEFAULTS` – conservative figures, not measured,
and every plan on it says so. A CPU "device" and its host are the same RAM: its memory is
the RAM, its usable bytes what is available now, and its host link a memcpy.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError

from moetune.config import RunConfig
from moetune.errors import ConfigError
from moetune.io import atomic_write_json
from moetune.plan.hardware import Card, HostLink, HostRates, register_host_card

CPU_CARD = "cpu"
UNCALIBRATED = "uncalibrated: run `moetune doctor --calibrate` to measure this host"


# What a rate may be: a number (not a string or a bool), finite, and within what a host can
# do – 1e308 GFLOP/s or 1e-300 GB/s would plan a step at 0 s or at ages, without a word.
GFLOPS, GB_PER_S = (1e-6, 1e6), (1e-6, 1e4)


def _rate(bounds: tuple[float, float], what: str) -> Any:
    low, high = bounds
    return Field(strict=True, allow_inf_nan=False, ge=low, le=high,
                 description=f"{what}; a number from {low:g} to {high:g}.")  # fmt: skip


class HostProfile(BaseModel):
    """host.json: one host's measured (or hand-given) rates and what identifies it."""

    model_config = ConfigDict(extra="forbid")

    cpu: str = Field(description="CPU model name (/proc/cpuinfo 'model name').")
    cores: PositiveInt = Field(
        strict=True, description="Logical CPUs of the host (os.cpu_count())."
    )
    threads: PositiveInt = Field(
        strict=True, description="torch threads the matmuls were measured with."
    )
    ram_bytes: PositiveInt = Field(strict=True, description="Total RAM in bytes.")
    measured_at: str = Field(description="When the figures were taken (ISO 8601, UTC).")
    fp32_gflops: float = _rate(
        GFLOPS, "fp32 matmul GFLOP/s at a step's expert shapes, all `threads`"
    )
    bf16_gflops: float = _rate(GFLOPS, "The same matmuls in bf16")
    memcpy_gb_per_s: float = _rate(
        GB_PER_S, "A large RAM-to-RAM copy in decimal GB/s (bytes copied per second)"
    )
    disk_read_gb_per_s: float = _rate(
        GB_PER_S, "Sequential read of the checkpoint's file system, decimal GB/s (O_DIRECT)"
    )
    disk_direct: bool = Field(
        True, description="True when the disk read bypassed the page cache (O_DIRECT)."
    )
    disk_path: str | None = Field(None, description="The directory the disk rate was read on.")
    source: Literal["calibrated", "by hand"] = Field(
        "by hand", description="calibrated: written by `moetune doctor --calibrate`."
    )

    def rates(self, where: str) -> HostRates:
        return HostRates(
            self.fp32_gflops, self.bf16_gflops, self.memcpy_gb_per_s,
            self.disk_read_gb_per_s, True, where,
        )  # fmt: skip


# No file: what a plan assumes (not measured). Per core: a shared server core reached 12.7
# fp32 GFLOP/s on a 1024² matmul (plan.offload's note); one memcpy thread ~5 GB/s; a cloud
# VM's block volume reads ~1 GB/s (this VM: 1.3 GB/s O_DIRECT, dd). All rounded down.
DEFAULTS = {"gflops_per_core": 10.0, "memcpy_gb_per_s": 5.0, "disk_read_gb_per_s": 1.0}


def host_file() -> Path:
    """Where host.json lives ($MOETUNE_HOST_FILE overrides, for tests and other hosts)."""
    if override := os.environ.get("MOETUNE_HOST_FILE"):
        return Path(override)
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "moetune" / "host.json"


def load_host(path: Path | None = None) -> HostProfile | None:
    """The host profile at `path` (default `host_file()`); None when there is none; a bad
    file is a ConfigError naming the field."""
    path = path or host_file()
    fix = "fix it (docs/lint.md lists the fields) or rerun `moetune doctor --calibrate`"
    if path.exists() and not path.is_file():  # a dir there is not "no host file"
        raise ConfigError(f"host file {path} is not a file", f"remove it or {fix}")
    if not path.is_file():
        return None
    try:
        return HostProfile.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})", fix) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(file)"
        raise ConfigError(f"{path}: {field}: {first['msg']}", fix) from None


def save_host(profile: HostProfile, path: Path | None = None) -> Path:
    """Write `profile` to `path` (default `host_file()`) atomically; returns the path."""
    path = path or host_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, profile.model_dump())
    return path


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; elsewhere what platform reports)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def ram() -> tuple[int, int]:
    """(total, available) RAM of this machine in bytes."""
    import psutil  # lazy: only a plan for this host needs it

    mem = psutil.virtual_memory()
    return int(mem.total), int(mem.available)


def default_rates() -> HostRates:
    cores = os.cpu_count() or 1
    flops = DEFAULTS["gflops_per_core"] * cores
    return HostRates(
        flops, flops, DEFAULTS["memcpy_gb_per_s"], DEFAULTS["disk_read_gb_per_s"],
        False, "defaults",
    )  # fmt: skip


def cpu_card() -> Card:
    """This host as a card: RAM from host.json (else this machine's), usable = the RAM
    available now (never more than the file's total), rates measured or defaults."""
    profile = load_host()
    total, available = ram()
    if profile is not None:
        total = profile.ram_bytes
    rates = profile.rates(str(host_file())) if profile else default_rates()
    name = f"this host ({profile.cpu if profile else cpu_name()})"
    link = HostLink("host-memcpy", "host RAM memcpy (CPU device)", rates.memcpy_gb_per_s)
    return Card(
        id=CPU_CARD, name=name, kind="cpu", memory_bytes=total,
        usable_bytes=min(available, total), bf16_tflops=rates.bf16_gflops / 1e3,
        runpod_gpu_type_id=None, usd_per_hour=None,
        notes=f"measured {profile.measured_at}" if profile else UNCALIBRATED,
        host_link=link, host_ram_bytes=total, rates=rates,
    )  # fmt: skip


def as_run_on(cfg: RunConfig, card: Card) -> RunConfig:
    """`cfg` as train runs it on `card`: a CPU computes fp32 unless train.precision is bf16,
    so its frozen weights are loaded fp32 whatever model.dtype says (train.setup)."""
    if not card.is_host or cfg.train.precision == "bf16":
        return cfg
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": "float32"})})


def has_cuda() -> bool:
    """A CUDA device is visible (plans then list the catalog's cards, not this host)."""
    import torch  # lazy: heavy to import (torch)

    return bool(torch.cuda.is_available())


register_host_card(CPU_CARD, cpu_card)
