"""Copies that are either complete and verified or absent: sha256 per file, compared with
the source's, before a copy is renamed into place."""

from __future__ import annotations

import hashlib
from pathlib import Path

from moetune.io import sha256_file
from moetune.lane.providers.base import LaneError


def file_digests(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `root` (or of `root` itself, as "")."""
    if root.is_file():
        return {"": sha256_file(root)}
    return {
        str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()
    }


def tree_digest(digests: dict[str, str]) -> str:
    """One sha256 for a whole tree: over sorted (path, file digest) pairs."""
    h = hashlib.sha256()
    for name, digest in sorted(digests.items()):
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()


def verify_tree(local: Path, expected: dict[str, str]) -> None:
    """LaneError unless `local` holds exactly the expected files with the expected bytes."""
    got = file_digests(local)
    missing = sorted(set(expected) - set(got))
    wrong = sorted(n for n in expected.keys() & got.keys() if expected[n] != got[n])
    if missing or wrong:
        what = f"missing {missing[:3]}" if missing else f"sha256 mismatch in {wrong[:3]}"
        raise LaneError(f"copy of {local.name} is not verified: {what}", "copy it out again")
