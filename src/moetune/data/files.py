"""Local data files read row by row, so an error names the file and the line: JSON Lines,
a JSON array (or JSON Lines named .json) and Parquet. Other kinds of source (csv, arrow, a
directory, a saved dataset, a hub id) go through `datasets` (sources.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from moetune.data.errors import DataError

# ---------------------------------------------------------------- readers, by suffix


def _bad_json(path: Path, line: int, exc: json.JSONDecodeError) -> DataError:
    return DataError(
        f"{path} line {line}: not valid JSON ({exc.msg}); nothing was trained",
        "fix or remove that line: each row must be one JSON object",
    )


def _read_jsonl(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"line {n}", json.loads(line)
        except json.JSONDecodeError as exc:
            raise _bad_json(path, n, exc) from None


def _read_json(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    """A JSON array of rows; anything else is read as JSON Lines (a common .json misnomer)."""
    if not text.lstrip().startswith("["):
        yield from _read_jsonl(path, text)
        return
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad_json(path, exc.lineno, exc) from None
    for n, row in enumerate(rows, 1):
        yield f"row {n}", row


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a leading BOM (Windows editors) is not a row
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}: not UTF-8 text (byte {exc.start})", "save the file as UTF-8 JSON Lines"
        ) from None


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{path}: not a readable Parquet file ({first})", "rewrite it") from None
    for n, row in enumerate(table.to_pylist(), 1):
        yield f"row {n}", row


READERS: dict[str, Callable[[Path], Iterator[tuple[str, Any]]]] = {
    ".jsonl": lambda p: _read_jsonl(p, _read_text(p)),
    ".json": lambda p: _read_json(p, _read_text(p)),
    ".parquet": _read_parquet,
}


def read_rows(path: Path) -> list[tuple[str, Any]]:
    """(where, row) for every row of a data file; DataError when missing, unknown or empty."""
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(
            f"{path}: unknown data file type {path.suffix!r}",
            f"use one of {', '.join(READERS)} (TRL row conventions)",
        )
    if path.is_dir():
        raise DataError(f"{path} is a directory, not a data file", "name the file inside it")
    if not path.is_file():
        raise DataError(f"data file {path} not found", "check the path in data.train_file")
    rows = list(reader(path))
    if not rows:
        raise DataError(f"{path} is empty: no rows", "add rows (one JSON object each)")
    return rows
