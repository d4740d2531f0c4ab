"""Export a trained adapter for the stack that serves it, and check served == trained.

Formats live in a registry (`moetune.export.registry.EXPORTERS`): merged (a standard
transformers checkpoint), vllm (an adapter plus the engine/request options vLLM needs),
gguf (a llama.cpp LoRA with stacked `*_exps` expert tensors) and mlx where its module is
present. Each writes into a fresh temp dir that is renamed onto `--out` only once it is
complete; an existing, non-empty `--out` is never overwritten.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from pathlib import Path

from moetune.errors import clip
from moetune.export.registry import (
    EXPORTERS,
    Exporter,
    ExportError,
    ExportOptions,
    ExportResult,
    Source,
    exporter,
    register,
)
from moetune.export.source import resolve_source
from moetune.registry import Registry

# Format modules register themselves on import; a missing one (mlx) is simply not offered.
FORMAT_MODULES = ("merged", "gguf", "vllm", "mlx")


def load_formats() -> Registry[Exporter]:
    """Import every format module present; the registry as it then stands."""
    for name in FORMAT_MODULES:
        module = f"moetune.export.{name}"
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    return EXPORTERS


def run_export(source: Source, fmt: str, out: Path, opts: ExportOptions) -> ExportResult:
    """Export `source` as `fmt` into `out` (created; refused when it exists and is not empty)."""
    load_formats()
    chosen = exporter(fmt)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(
            f"{clip(out, 80)} already exists and is not empty",
            "pass a new --out folder (moetune never overwrites files it did not write)",
        )
    tmp = out.with_name(f".{out.name}.export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        result = chosen.export(
            source, tmp, opts.model_copy(update={"destination": str(out.resolve())})
        )
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result.out = out
    return result


__all__ = [
    "EXPORTERS", "ExportError", "ExportOptions", "ExportResult", "Exporter", "Source",
    "exporter", "load_formats", "register", "resolve_source", "run_export",
]  # fmt: skip
