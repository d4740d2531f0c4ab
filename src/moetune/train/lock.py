"""One writer per run directory: `hold(root)` locks it for the whole run.

The lock is `flock` on a sibling file, `<parent>/.<name>.lock` – beside the run dir, not in
it, so it never makes the dir look foreign, survives `--overwrite` swapping the dir out,
and a refused second writer creates nothing inside. The kernel releases the lock when its
process ends however it ends (kill -9 included), so a stale file left by a dead process
is simply taken over; it holds the holder's pid, host and start time, which a refused
writer names. A clean release removes the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moetune.train.errors import TrainError


def lock_path(root: Path) -> Path:
    root = root.resolve()
    return root.with_name(f".{root.name}.lock")


@contextlib.contextmanager
def hold(root: Path) -> Iterator[dict[str, Any]]:
    """Hold the run dir `root` exclusively for the block; yields the holder record.
    Raises TrainError naming the holder when another process has it."""
    path = lock_path(root)
    fd = _acquire(path, root)
    try:
        yield _write_holder(fd)
    finally:
        with contextlib.suppress(OSError):
            if _same_file(fd, path):  # still ours: remove it before letting go
                path.unlink()
        os.close(fd)


def _acquire(path: Path, root: Path) -> int:
    """An fd of `path` with the lock held; retried when a releasing holder unlinked it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            if not _try_lock(fd):
                holder = read_holder(path)
                os.close(fd)
                raise TrainError(
                    f"{root} is in use by another moetune run ({describe(holder)})",
                    "wait for that run to end (or stop it), or choose another output.dir",
                )
            if _same_file(fd, path):
                return fd
            os.close(fd)  # locked a file its holder had just removed: take the new one
    except OSError as exc:
        raise TrainError(
            f"output dir {root} is not writable: its lock {path} cannot be made "
            f"({exc.strerror or exc})",
            "set output.dir to a directory you can write to (on a file system with locks)",
        ) from None


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False


def _write_holder(fd: int) -> dict[str, Any]:
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    return holder


def read_holder(path: Path) -> dict[str, Any]:
    """The holder's record; {} while it is being written or when unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown: it is just starting"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')}, since {since}"
