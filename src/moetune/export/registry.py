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

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from moetune.errors import MoetuneError, clip
from moetune.registry import Registry

SHARD_SIZE = re.compile(r"(?P<n>\d+(\.\d+)?)\s*(?P<unit>[KMGT]i?B|B)?", re.I)
VLLM_LAYOUTS = ("auto", "fused")


class ExportError(MoetuneError):
    """An adapter cannot be exported as asked (unknown format, keys the format cannot carry)."""


class ExportOptions(BaseModel):
    """Options every format receives; a format ignores those it has no use for."""

    model_config = ConfigDict(extra="forbid")

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
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

    @field_validator("max_shard_size")
    @classmethod
    def _shard_size(cls, value: str) -> str:
        match = SHARD_SIZE.fullmatch(value.strip())
        if not match or float(match["n"]) <= 0:
            raise ValueError("must be a positive size such as 5GB, 500MB or 2GiB")
        return value.strip()

    @field_validator("extra")
    @classmethod
    def _layout(cls, value: dict[str, Any]) -> dict[str, Any]:
        layout = value.get("vllm_layout", "auto")
        if layout not in VLLM_LAYOUTS:
            raise ValueError(f"vllm_layout must be one of: {', '.join(VLLM_LAYOUTS)}")
        return value


def export_options(**given: Any) -> ExportOptions:
    """ExportOptions from the CLI's flags; a bad value is refused naming its flag and choices."""
    try:
        return ExportOptions.model_validate(given)
    except ValidationError as err:
        first = err.errors()[0]
        field, shown = str(first["loc"][0]), first.get("input")
        if field == "extra":  # the one checked format option
            field, shown = "vllm_layout", given["extra"].get("vllm_layout")
        msg = first["msg"].removeprefix("Value error, ").replace(f"{field} must", "must")
        flag = f"--{field.replace('_', '-')}"
        raise ExportError(f"{flag} {clip(shown, 40)!r}: {msg}", f"pass a valid {flag}") from None


@dataclass(frozen=True)
class Source:
    """What is exported: a peft adapter dir and the base it was trained on."""

    adapter_dir: Path
    base: str  # a local dir or hub id, as the run config / adapter_config.json names it
    run_dir: Path | None = None  # set when a run dir was given: its config and eval items
    trust_remote_code: bool = False  # the base's own modeling code may run (the run's choice)
    tokenizer: str | None = None  # the run's model.tokenizer, when it names one (else base's)

    @property
    def tokenizer_dir(self) -> str:
        """Where the base's tokenizer is: model.tokenizer, else the base itself."""
        return self.tokenizer or self.base


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
    needs_weights: bool = True  # reads the base's tensors (False: its config.json is enough)


EXPORTERS: Registry[Exporter] = Registry("export format", ExportError)


def register(exporter: Exporter) -> Exporter:
    """Add a format (a name is registered once)."""
    return EXPORTERS.add(exporter.name, exporter)


def exporter(name: str) -> Exporter:
    """The registered format `name`, or a one-line error listing those there are."""
    return EXPORTERS.get(name)
