"""One writer per run directory: `hold(root)` locks it for the whole run.

The lock (`moetune.io.exclusive`: `flock`, released by the kernel however its holder ends)
is a sibling file, `<parent>/.<name>.lock` – beside the run dir, not in it, so it never
makes the dir look foreign, survives `--overwrite` swapping the dir out, and a refused
second writer creates nothing inside. It holds the holder's pid, host and start time, which
a refused writer names.
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moetune.errors import clip, os_problem
from moetune.io import Held, exclusive, read_holder
from moetune.train.errors import TrainError

__all__ = ["describe", "hold", "lock_path", "read_holder"]


def lock_path(root: Path) -> Path:
    root = root.resolve()
    return root.with_name(f".{root.name}.lock")


@contextlib.contextmanager
def hold(root: Path) -> Iterator[dict[str, Any]]:
    """Hold the run dir `root` exclusively for the block; yields the holder record.
    Raises TrainError naming the holder when another process has it."""
    path, stack = lock_path(root), contextlib.ExitStack()
    try:
        holder = stack.enter_context(exclusive(path))
    except Held as held:
        raise TrainError(
            f"{clip(root, 100)} is in use by another moetune run ({describe(held.holder)})",
            "wait for that run to end (or stop it), or choose another output.dir",
        ) from None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:  # a path of thousands of characters: named, cut
            raise TrainError(
                f"output dir {clip(root, 100)}: {os_problem(exc)}",
                "shorten output.dir (at most 255 bytes per name, 4096 in all on most systems)",
            ) from None
        raise TrainError(
            f"output dir {clip(root, 100)} is not writable: its lock {clip(path.name, 60)} "
            f"cannot be made ({os_problem(exc)})",
            "set output.dir to a directory you can write to (on a file system with locks)",
        ) from None
    with stack:
        yield holder


def describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown: it is just starting"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')}, since {since}"
