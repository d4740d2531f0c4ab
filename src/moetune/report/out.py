"""Where a report may be written: a writable file path that holds nothing of the user's."""

from __future__ import annotations

from pathlib import Path

from moetune.errors import MoetuneError, clip
from moetune.io import output_problem


class ReportError(MoetuneError):
    """A report cannot be built (the directory is not a moetune run, or --out is unusable)."""


# How a file this module wrote begins (the generator tag; reports before it: the title).
OWN_MARKS = (b'<meta name="generator" content="moetune report">', b"<title>moetune report")


def check_out(out: Path) -> None:
    """Refuse an `out` that cannot be written (a folder, a device, a read-only place), or
    that exists and is not a report moetune wrote: --out never replaces a user's file."""
    if problem := output_problem(out, OWN_MARKS, "a report"):
        raise ReportError(
            f"report --out {clip(out, 100)} {problem}",
            "pass --out a file path in a writable folder (e.g. report.html), or move yours away",
        )
