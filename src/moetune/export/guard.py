"""Export with train's care: one writer per `--out`, temp names that fit any legal `--out`,
a full disk as one line, and an output that says so while it is unchecked.

The lock is `flock` on a file beside `--out` named from a hash of its path, like the temp
dir, so a 250-byte basename (legal: 255 is the limit) never grows past the limit. The
kernel drops the lock however its holder ends. The `UNCHECKED` marker goes into the temp
dir before it is renamed onto `--out`, so an output interrupted between rename and check
(SIGTERM, Ctrl-C) is marked, with the command that checks it; the check removes it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moetune.errors import clip, os_problem
from moetune.export.registry import ExportError
from moetune.io import Held, atomic_write_text, exclusive
from moetune.units import human_bytes

UNCHECKED = "UNCHECKED"  # marker file in an export whose served == trained check has not run
RECORD = "export.json"  # what was exported from where: `--check-only` reads it


def check_command(out: Path) -> str:
    return f"moetune export --check-only {out}"


def _stem(out: Path) -> str:
    """`.moetune-export-<hash>`: a fixed-length sibling name for any `--out`."""
    digest = hashlib.sha256(str(out.resolve()).encode("utf-8", "surrogateescape")).hexdigest()
    return f".moetune-export-{digest[:16]}"


def temp_dir(out: Path) -> Path:
    return out.resolve().parent / f"{_stem(out)}.{os.getpid()}.tmp"


@contextlib.contextmanager
def hold_out(out: Path) -> Iterator[None]:
    """Hold `--out` exclusively for the block; a second export to it is refused, one line.
    A clean release removes the lock file (a waiting writer then locks a fresh one)."""
    path, stack = out.resolve().parent / f"{_stem(out)}.lock", contextlib.ExitStack()
    try:
        stack.enter_context(exclusive(path))
    except Held as held:
        raise ExportError(
            f"another moetune export is writing {clip(out, 80)} "
            f"(pid {held.holder.get('pid', 'unknown')})",
            "wait for it to finish, or pass another --out",
        ) from None
    except OSError as err:
        raise unwritable(out, err) from None
    with stack:
        yield


def unwritable(out: Path, err: OSError) -> ExportError:
    return ExportError(
        f"--out {clip(out, 80)} cannot be written: {os_problem(err)}",
        "pass an --out in a folder you may write to",
    )


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC as Python raises it, or as torch's / safetensors' writers word it."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return "No space left on device" in str(exc) or "unexpected pos " in str(exc)


@contextlib.contextmanager
def writing(out: Path) -> Iterator[None]:
    """OSErrors of the writes as one line: a full disk with its free space, a refused write."""
    try:
        yield
    except Exception as exc:
        if is_disk_full(exc):
            free = human_bytes(shutil.disk_usage(out.resolve().parent).free)
            raise ExportError(
                f"disk full while writing the export to {clip(out, 80)} ({free} free); "
                "nothing was left behind",
                "free space, or pass an --out on a disk with room for the export",
            ) from None
        if isinstance(exc, PermissionError | IsADirectoryError | NotADirectoryError):
            raise unwritable(out, exc) from None
        raise


def mark_unchecked(folder: Path, out: Path, why: str) -> None:
    atomic_write_text(
        folder / UNCHECKED,
        f"This export is unchecked: {why}.\nCheck it (served == trained) with:\n"
        f"  {check_command(out)}\n",
    )


def mark_checked(out: Path) -> None:
    (out / UNCHECKED).unlink(missing_ok=True)


def write_record(folder: Path, record: dict[str, Any]) -> None:
    atomic_write_text(folder / RECORD, json.dumps(record, indent=2) + "\n")


def read_record(out: Path) -> dict[str, Any]:
    """What `out` was exported from; refused for a folder no moetune export wrote."""
    try:
        record = json.loads((out / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        why = os_problem(err) if isinstance(err, OSError) else "not JSON"
        raise ExportError(
            f"{clip(out, 80)}/{RECORD}: {why} – --check-only needs the record every export writes",
            "pass a folder `moetune export` wrote (or export again)",
        ) from None
    if not isinstance(record, dict) or not {"format", "adapter", "base"} <= record.keys():
        raise ExportError(f"{clip(out, 80)}/{RECORD} is not an export record", "export again")
    return record
