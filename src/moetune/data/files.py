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
        f"{path} line {line}: not valid JSON ({exc.msg})",  # read for train and eval alike
        "fix or remove that line: each row must be one JSON object",
    )


class _DuplicateKey(ValueError):
    """A key twice in one JSON object: json keeps the last silently, so a row would train
    on one of two values the user wrote without a word."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _duplicate(path: Path, where: str, exc: _DuplicateKey) -> DataError:
    return DataError(
        f"{path} {where}: key {exc.args[0]!r} appears twice in one object (JSON would keep "
        "only the last)",
        "keep one of the two values in that row",
    )


def _read_jsonl(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"line {n}", json.loads(line, object_pairs_hook=_unique)
        except json.JSONDecodeError as exc:
            raise _bad_json(path, n, exc) from None
        except _DuplicateKey as exc:
            raise _duplicate(path, f"line {n}", exc) from None


def _read_json(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    """A JSON array of rows; anything else is read as JSON Lines (a common .json misnomer)."""
    if not text.lstrip().startswith("["):
        yield from _read_jsonl(path, text)
        return
    try:
        rows = json.loads(text, object_pairs_hook=_unique)
    except json.JSONDecodeError as exc:
        raise _bad_json(path, exc.lineno, exc) from None
    except _DuplicateKey as exc:
        raise _duplicate(path, "(a JSON array)", exc) from None
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


def refuse_special(path: Path) -> None:
    """A path that exists but is neither a file nor a dir (a FIFO, a device, a socket) is
    named as what it is: "not found" would send the user looking for a file that is there."""
    if path.exists() and not (path.is_file() or path.is_dir()):
        raise DataError(
            f"{path} is not a regular file (a FIFO, device or socket): rows are read from files",
            "point the source at a data file (.jsonl, .json, .parquet, .csv, .arrow) or a dir",
        )


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
    refuse_special(path)
    if not path.is_file():
        raise DataError(f"data file {path} not found", "check the path in data.train_file")
    rows = list(reader(path))
    if not rows:
        raise DataError(f"{path} is empty: no rows", "add rows (one JSON object each)")
    return rows
