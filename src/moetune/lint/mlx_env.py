"""What the installed mlx stack can do: mlx-lm/transformers pins known to break, and
whether mlx-lm has a backend here. The MLX rules, their probes and `moetune doctor` all
read it (so none of them imports another for it)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from functools import cache
from importlib import metadata, util


def version_tuple(text: str) -> tuple[int, ...]:
    """'0.31.2rc1' -> (0, 31, 2); enough for the pins below."""
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@dataclass(frozen=True)
class PinTrap:
    """A known-bad mlx-lm/transformers combination."""

    applies: Callable[[Mapping[str, str]], bool]
    message: str
    fix: str


def _mlx_needs_tf5(v: Mapping[str, str]) -> bool:
    return version_tuple(v["mlx-lm"]) >= (0, 30, 6) and version_tuple(
        v.get("transformers", "0")
    ) < (5,)


def _tf513_breaks_mlx031(v: Mapping[str, str]) -> bool:
    return v.get("transformers") == "5.13.0" and version_tuple(v["mlx-lm"])[:2] == (0, 31)


PIN_TRAPS = (
    PinTrap(
        _mlx_needs_tf5, "mlx-lm >= 0.30.6 needs transformers >= 5", "pip install 'transformers>=5'"
    ),
    PinTrap(
        _tf513_breaks_mlx031,
        "transformers 5.13.0 breaks `import mlx_lm` 0.31.x",
        "pip install 'transformers!=5.13.0'",
    ),
)


def pin_problems(versions: Mapping[str, str]) -> list[PinTrap]:
    """The known-bad combinations `versions` hits (none when mlx-lm is absent)."""
    if "mlx-lm" not in versions or versions["mlx-lm"] == "absent":
        return []
    return [trap for trap in PIN_TRAPS if trap.applies(versions)]


@dataclass(frozen=True)
class MlxBackend:
    """Whether mlx-lm can run here: mlx-lm's version, mlx's, and the device mlx computes on
    (metal / cuda / cpu), or why there is none."""

    mlx_lm: str | None
    mlx: str | None
    backend: str | None
    device: str | None
    error: str | None = None

    def to_json(self) -> dict[str, str | None]:
        return asdict(self)


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@cache
def mlx_backend() -> MlxBackend:
    """Import mlx.core (cheap: ~20 ms) and ask it for its device; never raises."""
    lm, core = _dist_version("mlx-lm"), _dist_version("mlx")
    if util.find_spec("mlx") is None:
        return MlxBackend(lm, core, None, None, "No module named 'mlx'")
    try:
        # lazy: heavy to import (mlx)
        import mlx.core as mx  # type: ignore[import-not-found]
    except ImportError as exc:  # mlx without its backend wheel (mlx-cpu / mlx-metal)
        return MlxBackend(lm, core, None, None, str(exc).splitlines()[0])
    kinds = [("metal", mx.metal), ("cuda", getattr(mx, "cuda", None))]
    gpu = next((name for name, mod in kinds if mod is not None and mod.is_available()), None)
    return MlxBackend(lm, core, gpu or "cpu", str(mx.default_device()))


MLX_INSTALL = "pip install 'moetune[mlx]' (mlx-lm with its backend), or use lora.stack=peft"


def backend_fix() -> str:
    """The install line that brings mlx-lm's backend on this platform."""
    if sys.platform == "darwin":
        return "pip install mlx (Apple silicon), or pip install 'moetune[mlx]'"
    return "pip install 'mlx[cpu]' (Linux x86-64, glibc >= 2.35), or pip install 'moetune[mlx]'"
