"""Reading a run dir's files for the report: a file that is missing or unreadable gives
its section "not available" with the reason, never an error (html and the sections share
these)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> tuple[dict[str, Any] | None, str]:
    """(the JSON object, "") or (None, why it cannot be used)."""
    if not path.is_file():
        return None, f"no {path.name} in {path.parent}"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{path} is unreadable: {exc}"
    if not isinstance(data, dict):
        return None, f"{path} does not hold a JSON object"
    return data, ""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The whole JSON-object rows; a torn last line (a run killed mid-write) is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append(row)
    return rows


def lookup(data: dict[str, Any], dotted: str) -> Any:
    """data["a"]["b"] for "a.b"; None where any part is missing."""
    node: Any = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def missing(why: str) -> dict[str, Any]:
    return {"missing": why}
