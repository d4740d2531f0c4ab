"""When the run dir's disk lets a run down: damaged checkpoints and a full disk.

A committed checkpoint can still be damaged later (a truncated copy, a disk error): resume
checks every file it would load and falls back to the newest one that is whole; a damaged
one is renamed `step-N.damaged` (kept, never deleted). A disk that fills up mid-save stops
the run with one line naming the path and the free space; committed checkpoints are
untouched, since the save was going to `.staging/` (checkpoint.py); `CheckpointCommitter`
commits a save only once it is whole.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from moetune.model.finite import NonFiniteError, require_finite_adapter
from moetune.train.errors import TrainError
from moetune.train.rundir.checkpoint import KEEP_CHECKPOINTS, STEP_PREFIX, RunDir, replace_dir
from moetune.units import human_bytes


def _safetensors_problem(path: Path) -> str | None:
    """A safetensors file is whole when it is as long as its header says."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if size < 8 or 8 + n > size:
            return f"truncated header ({size} bytes)"
        try:
            header = json.loads(fh.read(n))
        except ValueError:
            return "unreadable header"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    expected = 8 + n + max(ends, default=0)
    return f"truncated ({size} of {expected} bytes)" if size < expected else None


def _zip_problem(path: Path) -> str | None:
    """torch.save writes a zip; a truncated one has lost its central directory."""
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError):
        return "truncated or not a torch file"


def _json_problem(path: Path) -> str | None:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return "truncated or not JSON"
    return None


_CHECKS: dict[str, Callable[[Path], str | None]] = {
    ".safetensors": _safetensors_problem,
    ".pt": _zip_problem,
    ".pth": _zip_problem,
    ".bin": _zip_problem,
    ".json": _json_problem,
}


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why the checkpoint dir `ckpt` cannot be resumed from ("file: problem"), or None."""
    for path in sorted(ckpt.iterdir()):
        check = _CHECKS.get(path.suffix)
        problem = check(path) if check and path.is_file() else None
        if problem:
            return f"{path.name}: {problem}"
    return None


@dataclass(frozen=True)
class ResumePoint:
    """The newest whole checkpoint (None: start over) and the damaged newer ones."""

    checkpoint: tuple[int, Path] | None
    damaged: list[tuple[int, Path, str]] = field(default_factory=list)  # (step, dir, problem)


def resume_point_of(run: RunDir) -> ResumePoint:
    """Committed checkpoints, newest first, until one loads (read-only)."""
    damaged: list[tuple[int, Path, str]] = []
    for step, ckpt in reversed(run.checkpoints_done()):
        problem = checkpoint_problem(ckpt)
        if problem is None:
            require_finite_checkpoint(step, ckpt)
            return ResumePoint((step, ckpt), damaged)
        damaged.append((step, ckpt, problem))
    return ResumePoint(None, damaged)


def require_finite_checkpoint(step: int, ckpt: Path) -> None:
    """A whole checkpoint whose adapter holds NaN/Inf is not resumed from: the run had
    diverged by then, and training on would only spread it (exit 2, the tensor named)."""
    try:
        require_finite_adapter(ckpt)
    except NonFiniteError as err:
        raise NonFiniteError(
            f"--resume: checkpoint step {step}: {err.cause}",
            f"the run diverged by step {step}: move {ckpt} aside to resume from an earlier "
            "checkpoint (with a lower train.learning_rate), or start a new output.dir",
        ) from None


def set_aside(point: ResumePoint) -> list[str]:
    """Rename each damaged checkpoint out of resume's way (kept); one line on each."""
    start = f"step {point.checkpoint[0]}" if point.checkpoint else "the start (none is whole)"
    lines = []
    for step, ckpt, problem in point.damaged:
        kept = ckpt.with_name(f"{ckpt.name}.damaged")
        for n in range(2, 1000):  # an earlier damaged copy of the same step stays too
            if not kept.exists():
                break
            kept = ckpt.with_name(f"{ckpt.name}.damaged-{n}")
        os.replace(ckpt, kept)
        lines.append(
            f"checkpoint step {step} is damaged ({problem}); resuming from {start} "
            f"instead – the damaged one is kept as {kept}"
        )
    return lines


# How a full disk reads when torch.save's C++ writer or safetensors' Rust one hits it
# (torch: "unexpected pos 704 vs 598" writing to /dev/full; never a reader's message).
_WRITER_FAILED = ("No space left on device", "PytorchStreamWriter", "unexpected pos ")


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC as Python raises it, or as torch.save / safetensors report it."""
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOSPC
    return any(text in str(exc) for text in _WRITER_FAILED)


@contextlib.contextmanager
def disk_full_stops(run: RunDir) -> Iterator[None]:
    """A full disk as one line naming the path and the free space."""
    try:
        yield
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        where = getattr(exc, "filename", None) or run.staging
        raise stopped(run, f"disk full while writing {where}") from None


def require_whole(run: RunDir, staged: Path, step: int) -> None:
    """A save that reported success can still be short: torch's C++ writer does not always
    report a full disk. Such a checkpoint is never committed."""
    problem = checkpoint_problem(staged)
    if problem:
        raise stopped(run, f"checkpoint step {step} came out incomplete ({problem}; disk full?)")


def stopped(run: RunDir, what: str) -> TrainError:
    """The one-line error of a save that failed: free space and the checkpoint still intact.
    The torn save in `.staging/` is cleared (moetune's own temp; clearing frees space)."""
    shutil.rmtree(run.staging, ignore_errors=True)
    free = human_bytes(shutil.disk_usage(run.root).free)
    last = run.last_checkpoint()
    kept = f"checkpoint step {last[0]} is intact" if last else "no checkpoint was committed"
    return TrainError(
        f"{what} ({free} free on {run.root}); {kept}",
        "free disk space (or move output.dir), then run the same `moetune train` with --resume",
    )


class CheckpointCommitter(TrainerCallback):
    """After each save, publish `.staging/checkpoint-N` as `checkpoints/step-N` in one rename."""

    def __init__(self, run: RunDir) -> None:
        self.run = run

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # lazy: heavy to import (accelerate)
        from accelerate import PartialState

        PartialState().wait_for_everyone()  # every rank has written its part (RNG states)
        if args.should_save:
            staged = self.run.staging / f"checkpoint-{state.global_step}"
            require_whole(self.run, staged, state.global_step)
            replace_dir(staged, self.run.checkpoints / f"{STEP_PREFIX}{state.global_step}")
            for _, old in self.run.checkpoints_done()[:-KEEP_CHECKPOINTS]:
                trash = old.with_name(f".{old.name}.old")  # out of sight first, then deleted
                os.replace(old, trash)
                shutil.rmtree(trash, ignore_errors=True)
        PartialState().wait_for_everyone()
