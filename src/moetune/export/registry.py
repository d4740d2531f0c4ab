"""The export format registry: one `Exporter` per `--format`.

A format module registers itself with one line at import time::

    register(Exporter("mlx", export_mlx, summary="mlx-lm adapter (LoRASwitchLinear keys)"))

and `moetune export --format mlx` then finds it. `export` receives the resolved source
(adapter dir, base model, the run dir when there is one) and writes into `out`, a fresh
temp dir that is renamed onto the user's `--out` only once the export completed; it
returns what it wrote (`ExportResult`). `check` (optional) runs the format's consumer and
compares it with the peft adapter – see moetune.export.check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from moetune.errors import MoetuneError
from moetune.registry import Registry


class ExportError(MoetuneError):
    """An adapter cannot be exported as asked (unknown format, keys the format cannot carry)."""


class ExportOptions(BaseModel):
    """Options every format receives; a format ignores those it has no use for."""

    model_config = ConfigDict(extra="forbid")

    dtype: str = Field(
        "auto",
        description="Weights dtype: auto (the base's own; bf16 when unset) | bfloat16 | float16 "
        "| float32.",
    )
    max_shard_size: str = Field("5GB", description="Largest safetensors shard the merge writes.")
    family: str | None = Field(None, description="vLLM / llama.cpp architecture override.")
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Format-specific options (vllm_layout: auto | fused)."
    )
    destination: str | None = Field(
        None, description="The --out the temp dir becomes (for paths written into files)."
    )


@dataclass(frozen=True)
class Source:
    """What is exported: a peft adapter dir and the base it was trained on."""

    adapter_dir: Path
    base: str  # a local dir or hub id, as the run config / adapter_config.json names it
    run_dir: Path | None = None  # set when a run dir was given: its config and eval items


@dataclass
class ExportResult:
    """What an export wrote. `files` are relative to `out`; `notes` are shown to the user."""

    format: str
    out: Path
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format, "out": str(self.out), "files": self.files,
            "notes": self.notes, "details": self.details,
        }  # fmt: skip


ExportFn = Callable[[Source, Path, ExportOptions], ExportResult]


@dataclass(frozen=True)
class Exporter:
    """One format: `export(source, out, options)` writes into `out` (a fresh temp dir)."""

    name: str
    export: ExportFn
    summary: str = ""


EXPORTERS: Registry[Exporter] = Registry("export format", ExportError)


def register(exporter: Exporter) -> Exporter:
    """Add a format (a name is registered once)."""
    return EXPORTERS.add(exporter.name, exporter)


def exporter(name: str) -> Exporter:
    """The registered format `name`, or a one-line error listing those there are."""
    return EXPORTERS.get(name)
