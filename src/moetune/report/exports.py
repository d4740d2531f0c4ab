"""The report's "Export" section: each format exported from the run (RUN_DIR/exports.json,
written by `moetune export`) with its served == trained check."""

from __future__ import annotations

from typing import Any

from moetune.report.inputs import missing, read_json


def exports_section(inp: Any) -> dict[str, Any]:
    path = inp.run_dir / "exports.json"
    if not path.is_file():  # not exported yet: nothing is missing from the run
        return {
            "rows": [],
            "hint": "not exported yet: `moetune export RUN_DIR --format merged --out DIR`",
        }
    doc, why = read_json(path)
    if doc is None:
        return missing(why)
    return {"rows": [export_row(fmt, entry) for fmt, entry in sorted(doc.items())], "hint": ""}


def export_row(fmt: str, entry: dict[str, Any]) -> dict[str, Any]:
    check = entry.get("check") or {}
    if "skipped" in check:
        status, detail = "not checked", str(check["skipped"])
    else:
        status = "served == trained" if check.get("passed") else "FAILS"
        detail = check.get("reason") or (
            f"{check.get('items')} items · logits rel {check.get('logits_rel', 0):.2g} · "
            f"expert effect {check.get('expert_effect', 0):.2g} · greedy equal "
            f"{check.get('greedy_match', 0):.0%}"
        )
    ok = bool(check.get("passed"))
    if entry.get("unpromoted"):  # served == trained says nothing of an adapter that failed
        status, ok, detail = f"{status} · NOT PROMOTED", False, f"{entry['unpromoted']} · {detail}"
    return {
        "format": fmt, "out": str(entry.get("out", "")), "consumer": check.get("consumer", "–"),
        "status": status, "ok": ok, "detail": detail,
    }  # fmt: skip
