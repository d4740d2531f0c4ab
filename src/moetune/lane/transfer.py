"""Copies that are either complete and verified or absent: sha256 per file, compared with
the source's, before a copy is renamed into place."""

from __future__ import annotations

from pathlib import Path

from moetune.io import file_digests
from moetune.lane.providers.base import LaneError


def verify_tree(local: Path, expected: dict[str, str]) -> None:
    """LaneError unless `local` holds exactly the expected files with the expected bytes."""
    got = file_digests(local)
    missing = sorted(set(expected) - set(got))
    wrong = sorted(n for n in expected.keys() & got.keys() if expected[n] != got[n])
    if missing or wrong:
        what = f"missing {missing[:3]}" if missing else f"sha256 mismatch in {wrong[:3]}"
        raise LaneError(f"copy of {local.name} is not verified: {what}", "copy it out again")
