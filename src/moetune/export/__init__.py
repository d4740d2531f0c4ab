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
from moetune.export.guard import (
    RECORD,
    UNCHECKED,
    check_command,
    mark_unchecked,
    temp_dir,
    write_record,
    writing,
)
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
from moetune.io import share_by_umask, write_problem
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


def run_export(
    source: Source, fmt: str, out: Path, opts: ExportOptions, unchecked: str = "it was never run"
) -> ExportResult:
    """Export `source` as `fmt` into `out` (created; refused when it exists and is not empty).
    `out` holds `export.json` (what was exported) and an UNCHECKED marker saying `unchecked`
    until the check removes it."""
    load_formats()
    chosen = exporter(fmt)
    refuse_unchecked(out)
    problem = write_problem(out, folder=True)  # a file in the way is not "not empty"
    if problem:
        raise ExportError(f"--out {clip(out, 80)} {problem}", "pass a new --out folder")
    if out.exists() and any(out.iterdir()):
        raise ExportError(
            f"{clip(out, 80)} already exists and is not empty",
            "pass a new --out folder (moetune never overwrites files it did not write)",
        )
    tmp = temp_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing(out):
            tmp.mkdir(parents=True)
            final = opts.model_copy(update={"destination": str(out.resolve())})
            result = chosen.export(source, tmp, final)
            write_record(tmp, record_of(source, result))
            mark_unchecked(tmp, out, unchecked)
            share_by_umask(tmp)  # the weights as readable as the user's umask allows
            if out.exists():
                out.rmdir()  # empty (checked above)
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result.out = out
    return result


def refuse_unchecked(out: Path) -> None:
    """An earlier export into `out` whose check never passed: say how to check it, rather
    than export again over it (it is kept as it is)."""
    if (out / UNCHECKED).is_file() and (out / RECORD).is_file():
        raise ExportError(
            f"{clip(out, 80)} holds an earlier export that was never checked ({UNCHECKED})",
            f"check it with `{check_command(out)}`, or pass a new --out folder",
        )


def record_of(source: Source, result: ExportResult) -> dict[str, object]:
    """export.json: enough to check the export again later (`moetune export --check-only`)."""
    base = Path(source.base)
    return {
        "format": result.format, "adapter": str(source.adapter_dir.resolve()),
        "run_dir": str(source.run_dir.resolve()) if source.run_dir else None,
        "base": str(base.resolve()) if base.is_dir() else source.base,
        "dtype": str(result.details.get("dtype", "float32")), "files": result.files,
        "trust_remote_code": source.trust_remote_code,
        **survival_of(result),
    }  # fmt: skip


def survival_of(result: ExportResult) -> dict[str, object]:
    """A re-quantised merge's survival figures without the per-stack table (export.json)."""
    figures = result.details.get("survival")
    if not isinstance(figures, dict):
        return {}
    return {"survival": {k: v for k, v in figures.items() if k != "stacks"}}


__all__ = [
    "EXPORTERS", "ExportError", "ExportOptions", "ExportResult", "Exporter", "Source",
    "exporter", "load_formats", "register", "resolve_source", "run_export",
]  # fmt: skip
