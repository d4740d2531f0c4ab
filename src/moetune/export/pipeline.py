"""`moetune export`: resolve the source, export, check served == trained, ledger it.

The check's verdict is written to OUT/check.json and, for a run dir, into RUN_DIR/exports.json
(what `moetune report` shows); every attempt lands in the ledger as kind "export" – a
failed check as a failed row, with its reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from moetune.config import load_config
from moetune.export import ExportOptions, load_formats, resolve_source, run_export
from moetune.export.check import (
    CheckFailed,
    CheckOptions,
    CheckResult,
    ConsumerUnavailable,
    check_export,
    eval_texts,
)
from moetune.export.guard import (
    UNCHECKED,
    check_command,
    hold_out,
    mark_checked,
    mark_unchecked,
    read_record,
)
from moetune.export.registry import ExportResult, Source
from moetune.export.source import (
    require_buildable,
    require_promoted,
    require_weights,
    require_whole_adapter,
)
from moetune.io import atomic_write_json
from moetune.ledger import DEFAULT_PATH, attempt
from moetune.model.finite import require_finite_adapter
from moetune.train.rundir.checkpoint import ledger_fields


def ledger_of(source: Source) -> tuple[Path, dict[str, Any]]:
    """The run's ledger and row fields (run id, config hash, versions), or the default ledger."""
    if source.run_dir is None:
        return DEFAULT_PATH, {"run_id": source.adapter_dir.resolve().parent.name}

    cfg = load_config(source.run_dir / "config.yaml")
    return Path(cfg.output.ledger), ledger_fields(cfg)


def export(
    path: Path,
    fmt: str,
    out: Path,
    opts: ExportOptions,
    check: CheckOptions | None,
    base: str | None = None,
    trust_remote_code: bool = False,
    unpromoted: bool = False,
) -> dict[str, Any]:
    """Export (and check unless `check` is None); the summary. A failed check raises
    CheckFailed after check.json and the ledger row are written. An evaluated adapter the
    gate did not promote is refused unless `unpromoted` (then the export says so)."""
    chosen = load_formats().get(fmt)  # an unknown format is refused before anything is read
    source = resolve_source(path, base, trust_remote_code)
    not_promoted = require_promoted(source, unpromoted)  # before anything is read or written
    require_buildable(source)
    require_whole_adapter(source.adapter_dir)
    needs_base = check is not None or chosen.needs_weights
    ignored = require_weights(source.base) if needs_base else []
    ledger, fields = ledger_of(source)
    with hold_out(out), interrupted_says(out), attempt(ledger, "export", **fields) as row:
        row["metrics"] = {"format": fmt, "out": str(out)}  # a failed export says what it was
        require_finite_adapter(source.adapter_dir)  # NaN merged into weights: refused first
        # no items to check on: refused before anything is written
        texts = eval_texts(source, check.items_file, check.items) if check else None
        why = "its served == trained check had not finished" if check else "--no-check"
        result = run_export(source, fmt, out, opts, unchecked=why)
        result.notes += ignored + ([not_promoted] if not_promoted else [])
        doc = {**result.to_json(), "adapter": str(source.adapter_dir), "base": source.base}
        doc["unpromoted"] = not_promoted
        return checked(source, result, check, texts, doc, row)


def check_only(out: Path, check: CheckOptions) -> dict[str, Any]:
    """`moetune export --check-only OUT`: the served == trained check of an existing export."""
    record = read_record(out)
    run_dir = record.get("run_dir")
    source = Source(
        Path(record["adapter"]), str(record["base"]), Path(run_dir) if run_dir else None,
        bool(record.get("trust_remote_code")),
    )  # fmt: skip
    require_buildable(source)
    require_whole_adapter(source.adapter_dir)
    ledger, fields = ledger_of(source)
    with hold_out(out), interrupted_says(out), attempt(ledger, "export", **fields) as row:
        row["metrics"] = {"format": record["format"], "out": str(out), "check_only": True}
        texts = eval_texts(source, check.items_file, check.items)
        result = ExportResult(record["format"], out, files=list(record.get("files", [])))
        result.details["dtype"] = record.get("dtype", "float32")
        doc = {**result.to_json(), "adapter": str(source.adapter_dir), "base": source.base}
        return checked(source, result, check, texts, doc, row)


def checked(
    source: Source, result: ExportResult, check: CheckOptions | None, texts: list[str] | None,
    doc: dict[str, Any], row: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """Run the check on `result.out`, write check.json (the marker goes), record it."""
    out, fmt = result.out, result.format
    verdict, doc["check"] = run_check(source, fmt, out, result, check, texts)
    if verdict is not None:
        atomic_write_json(out / "check.json", doc["check"])
        mark_checked(out)
    elif check is not None:  # no consumer here: the marker says why
        mark_unchecked(out, out, doc["check"]["skipped"])
    record_in_run(source, fmt, doc)
    row["metrics"] = ledger_metrics(fmt, out, doc["check"])
    if verdict is not None and not verdict.passed:
        raise CheckFailed(
            f"served != trained ({verdict.consumer}): {verdict.reason}",
            fix_for(fmt, str(result.details.get("dtype", ""))),
        )
    return doc


@contextmanager
def interrupted_says(out: Path) -> Iterator[None]:
    """Ctrl-C / SIGTERM during an export: the fix says what was left and how to check it
    (an export is no run: `train --resume` has nothing to continue)."""
    try:
        yield
    except KeyboardInterrupt as err:
        if (out / UNCHECKED).exists():
            err.add_note(f"{out} is complete but unchecked: run `{check_command(out)}`")
        else:
            err.add_note(f"nothing was written to {out}: rerun the same export")
        raise


def run_check(
    source: Source, fmt: str, out: Path, result: ExportResult, check: CheckOptions | None,
    texts: list[str] | None,
) -> tuple[CheckResult | None, dict[str, Any]]:  # fmt: skip
    """The check's result and its JSON; (None, why) when it is off or no consumer runs here."""
    if check is None:
        return None, {"skipped": "--no-check"}
    dtype = str(result.details.get("dtype", "float32"))
    try:
        verdict = check_export(source, fmt, out, dtype, check, texts)
    except ConsumerUnavailable as why:
        return None, {"skipped": str(why)}
    return verdict, verdict.to_json()


def ledger_metrics(fmt: str, out: Path, check: dict[str, Any]) -> dict[str, Any]:
    keep = ("consumer", "passed", "items", "logits_rel", "expert_effect", "greedy_match", "skipped")
    return {"format": fmt, "out": str(out), **{k: check[k] for k in keep if k in check}}


def fix_for(fmt: str, dtype: str) -> str:
    if fmt == "merged" and dtype != "float32":
        return (
            f"W + ΔW rounded to {dtype} can lose a ΔW this small: re-export with --dtype float32 "
            "(twice the bytes), or serve the adapter unmerged"
        )
    return f"do not serve this {fmt} export; OUT/check.json has the per-item figures"


def record_in_run(source: Source, fmt: str, doc: dict[str, Any]) -> None:
    """RUN_DIR/exports.json: format -> the latest export's out dir and check (for the report)."""
    if source.run_dir is None:
        return
    path = source.run_dir / "exports.json"
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        known = {}
    known[fmt] = {"out": doc["out"], "files": doc["files"], "check": doc["check"],
                  "unpromoted": doc.get("unpromoted")}  # fmt: skip
    atomic_write_json(path, known)
