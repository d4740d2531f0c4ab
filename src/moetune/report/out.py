"""Where a report may be written: a writable file path that holds nothing of the user's."""

from __future__ import annotations

from pathlib import Path

from moetune.errors import MoetuneError, clip
from moetune.io import foreign_file, write_problem


class ReportError(MoetuneError):
    """A report cannot be built (the directory is not a moetune run, or --out is unusable)."""


# How a file this module wrote begins (the generator tag; reports before it: the title).
OWN_MARKS = (b'<meta name="generator" content="moetune report">', b"<title>moetune report")


def check_out(out: Path) -> None:
    """Refuse an `out` that cannot be written (a folder, a device, a read-only place), or
    that exists and is not a report moetune wrote: --out never replaces a user's file."""
    if problem := write_problem(out):
        raise ReportError(
            f"report --out {clip(out, 100)} {problem}",
            "pass --out a file path in a writable folder (e.g. report.html)",
        )
    if foreign_file(out, OWN_MARKS):
        raise ReportError(
            f"{out} exists and is not a report moetune wrote; it is never overwritten",
            "pass --out with a new file name, or move that file away",
        )
