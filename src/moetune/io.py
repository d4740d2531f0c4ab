"""Files a user owns are never half-written: write to a temp file, fsync, rename."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

PROMOTED = "PROMOTED"  # marker `moetune gate --promote` writes into an adapter dir (train and
# eval both honour it: --overwrite never removes it, the adapter digest leaves it out)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to a temp file beside `path`, fsync it, and rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("x", encoding="utf-8") as fh:  # "x": the umask's permissions, unlike mkstemp
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, payload: Any) -> None:
    atomic_write_text(path, json.dumps(payload, indent=2, default=str) + "\n")


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digests(root: Path, skip: frozenset[str] = frozenset()) -> dict[str, str]:
    """{relative path: sha256} of every file under `root` (or of `root` itself, as ""),
    files named in `skip` left out."""
    if root.is_file():
        return {"": sha256_file(root)}
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name not in skip)
    return {str(p.relative_to(root)): sha256_file(p) for p in files}


def tree_digest(digests: dict[str, str]) -> str:
    """One sha256 for a whole tree: over sorted (path, file digest) pairs."""
    h = hashlib.sha256()
    for name, digest in sorted(digests.items()):
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()
