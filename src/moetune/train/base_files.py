"""The base's weight files stay the ones the run loaded: each file's identity (size,
mtime_ns, inode – the file the path names now) is recorded before the weights load and
compared before every checkpoint and before the final adapter is saved. A file rewritten in
place (same size, other bytes: a re-download, a second tool converting in place) would
otherwise leave an adapter trained on two different bases – and, with train.offload: disk,
whose experts are read from the files at every step, on weights nobody loaded. A change
stops the run in one line naming the file; no adapter is promoted as trained over them.

Not a digest: reading a 600 GB base twice costs more than the run's first steps. A write
that restores the file's mtime and size behind itself is not noticed (the ctime would tell,
but a chmod or a hard link changes it too)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from moetune.errors import clip
from moetune.model.weight_files import checkpoint_files
from moetune.train.errors import TrainError

Identity = tuple[int, int, int]  # (size, mtime_ns, inode) of the file the path resolves to


def _identity(path: Path) -> Identity | None:
    try:
        st = path.stat()
    except OSError:
        return None  # gone: a change too
    return st.st_size, st.st_mtime_ns, st.st_ino


def base_identity(model_dir: str | None) -> dict[Path, Identity | None]:
    """Each weight file of a local base and its identity now ({} for a hub id)."""
    if model_dir is None or not os.path.isdir(model_dir):
        return {}
    return {path: _identity(path) for path in checkpoint_files(model_dir)}


def check_unchanged(recorded: dict[Path, Identity | None], when: str) -> None:
    """TrainError naming the first weight file that is not the one loaded."""
    for path, before in recorded.items():
        now = _identity(path)
        if now == before:
            continue
        how = "is gone" if now is None else "was rewritten (size, mtime or inode changed)"
        raise TrainError(
            f"base weight file {clip(path.name, 80)} {how} since the run loaded it; stopped "
            f"{when}: the adapter would be trained over weights the base no longer holds",
            "restore the base's files as they were (or re-download them) and rerun; "
            "nothing was saved over the earlier checkpoints",
        )


class BaseFilesCallback(TrainerCallback):
    """Before each checkpoint (on_step_end with a save due, before the Trainer writes it)."""

    def __init__(self, recorded: dict[Path, Identity | None]) -> None:
        self.recorded = recorded

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_save and self.recorded:
            check_unchanged(self.recorded, f"before the step-{state.global_step} checkpoint")
