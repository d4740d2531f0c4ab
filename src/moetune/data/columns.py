"""A column (a row's key) named twice in a data file that `datasets` or pyarrow reads: the
jsonl reader refuses a key stated twice in a row (files.py); these readers would rename
one (pandas' csv: `text`, `text.1`, so the second column is dropped without a word) or fail
with a message naming no source. Each is refused in the same words, naming the file."""

from __future__ import annotations

import csv
import re
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from moetune.data.errors import DataError

FIX = "keep one of the two values in each row (give the columns distinct names)"
# pyarrow's JSON reader (datasets' json builder), on a key twice in one object
_ARROW_JSON = re.compile(r"Column\(/(.+?)\) was specified twice")


def _twice(names: list[str]) -> str | None:
    return next((name for name, n in Counter(names).items() if n > 1), None)


def _csv_header(path: Path) -> list[str]:
    with path.open(newline="", encoding="utf-8-sig", errors="replace") as f:
        return next(csv.reader(f), [])


def _arrow_schema(path: Path) -> list[str]:
    """The field names of an Arrow IPC file, stream format (datasets' own) or file format."""
    for opener in (pa.ipc.open_stream, pa.ipc.open_file):
        try:
            with pa.memory_map(str(path)) as source:
                return list(opener(source).schema.names)
        except pa.ArrowInvalid:
            continue
    return []  # not Arrow at all: datasets says what it is


HEADERS = {".csv": _csv_header, ".arrow": _arrow_schema,
           ".parquet": lambda p: list(pq.read_schema(p).names)}  # fmt: skip


def refuse_duplicate_columns(path: Path) -> None:
    """A csv / arrow / parquet file whose header names one column twice is refused."""
    header = HEADERS.get(path.suffix.lower())
    try:
        name = _twice(header(path)) if header else None
    except (OSError, pa.ArrowException):
        return  # unreadable: the reader that follows names why
    if name is not None:
        raise DataError(f"{path}: column {name!r} appears twice (a reader keeps only one)", FIX)


def duplicate_key(lab: str, exc: BaseException) -> DataError | None:
    """pyarrow's JSON error on a key twice in one object, as the jsonl reader says it."""
    found = _ARROW_JSON.search(str(exc))
    if found is None:
        return None
    return DataError(
        f"source {lab}: key {found.group(1)!r} appears twice in one object (JSON would keep "
        "only the last)",
        "keep one of the two values in that row",
    )
