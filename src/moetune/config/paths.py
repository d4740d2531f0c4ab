"""A run dir that works from anywhere: the paths a run needs, fixed when it is made and
found again wherever its dir is used from.

When a run starts, every path field (data files, rung files, a local base, the ledger, the
run dir itself) is made absolute against the working directory, so the saved config.yaml
names no place relative to where the run happened to start. When a run dir's config.yaml
is read again, `output.dir` becomes the dir it is read from (a copied run writes into the
copy, never into the original) and each other path is looked for, in order: at the same
place relative to the run dir as it was when the run was made (data copied along with the
run), as saved, and – for a run saved before paths were absolute – relative to the
working directory it was made in, which is the run dir minus its saved relative
`output.dir`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from moetune.config.sections import RunConfig

# (section, field) of every path a run reads or writes besides its own dir
PATH_FIELDS = (
    ("data", "train_file"), ("data", "eval_file"), ("output", "ledger"),
    ("eval", "results_dir"),
)  # fmt: skip
RUNG_FIELDS = ("data", "include_path")


def _get(cfg: RunConfig) -> list[tuple[Any, str]]:
    """(owner object, field name) of every path field, rungs included."""
    fields = [(getattr(cfg, section), name) for section, name in PATH_FIELDS]
    fields += [(rung, name) for rung in cfg.eval.rungs for name in RUNG_FIELDS]
    return fields


def anchor(cfg: RunConfig, cwd: Path | None = None) -> RunConfig:
    """A copy of `cfg` with every relative path made absolute against `cwd` (a model id
    only when it names a local dir: otherwise it is a hub id)."""
    here = (cwd or Path.cwd()).resolve()
    out = cfg.model_copy(deep=True)
    out.output.dir = str(_absolute(out.output.dir, here))
    for owner, name in _get(out):
        value = getattr(owner, name)
        if value:
            setattr(owner, name, str(_absolute(value, here)))
    for name in ("id", "tokenizer"):  # a hub id stays as it is
        value = getattr(out.model, name)
        if value and (here / value).is_dir():
            setattr(out.model, name, str(_absolute(value, here)))
    return out


def _absolute(value: str, here: Path) -> Path:
    path = Path(value).expanduser()
    return Path(os.path.normpath(path if path.is_absolute() else here / path))


def rebase(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """`cfg` as saved in `run_dir`/config.yaml, pointed at `run_dir` wherever it now is."""
    here = run_dir.resolve()
    saved_root = Path(cfg.output.dir)
    origin = _origin(saved_root, here)
    out = cfg.model_copy(deep=True)
    out.output.dir = str(here)
    for owner, name in _get(out):
        value = getattr(owner, name)
        if value:
            setattr(owner, name, str(_find(Path(value), saved_root, here, origin)))
    model = Path(out.model.id)
    if model.is_absolute() or (origin is not None and (origin / model).is_dir()):
        out.model.id = str(_find(model, saved_root, here, origin))
    return out


def _origin(saved_root: Path, here: Path) -> Path | None:
    """The working dir a run with a relative output.dir was made in, when `here` ends so."""
    if saved_root.is_absolute():
        return None
    parts = Path(os.path.normpath(saved_root)).parts
    if len(parts) <= len(here.parts) and here.parts[-len(parts) :] == parts:
        return Path(*here.parts[: -len(parts)])
    return None


def _find(path: Path, saved_root: Path, here: Path, origin: Path | None) -> Path:
    """The first of: the same place relative to the run dir, as saved, relative to the
    origin; as saved when none exists (its error then names the saved path)."""
    base = origin or Path()  # unknown origin: both relative to one place, which relpath needs
    root = saved_root if saved_root.is_absolute() else base / saved_root
    stored = path if path.is_absolute() else base / path
    moved = here / os.path.relpath(stored, root)
    for candidate in (moved, stored):
        if candidate.exists():
            return Path(os.path.normpath(candidate))
    return path if path.is_absolute() else Path(os.path.normpath(stored))
