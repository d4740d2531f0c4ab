"""A directory source's data files, by the builder that reads them.

`datasets.load_dataset(dir)` reads the files of the most common kind only: a dir holding a
parquet and a jsonl trains on the parquet and never says so. Here the files of the
configured split are sorted by kind; a dir of one kind is left to datasets (it reads all of
them), a mixed one is read whole – each kind moetune reads loaded, and a data file of a
kind it does not read named before anything is built. Images, audio and video beside the
rows are what rows point at, not rows; a dataset card (README.md) is not data either.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetune.data.errors import DataError

BUILDERS = {".csv": "csv", ".arrow": "arrow", ".jsonl": "json", ".json": "json",
            ".parquet": "parquet"}  # fmt: skip
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")  # datasets opens these by the inner suffix
# datasets' modules for files that are not rows: media rows point at, dataset cards, configs
NOT_ROWS = ("imagefolder", "audiofolder", "videofolder", "pdffolder", "niftifolder",
            "meshfolder", "harbor")  # fmt: skip


def kind(path: str) -> str:
    """A data file's suffix, past a compression suffix (x.jsonl.gz is .jsonl)."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if len(suffixes) > 1 and suffixes[-1] in COMPRESSED:
        return suffixes[-2]
    return suffixes[-1] if suffixes else ""


@dataclass(frozen=True)
class DirFiles:
    """The files of one split of a dir: those moetune reads, by builder, and the rest."""

    by_builder: dict[str, list[str]] = field(default_factory=dict)
    unread: list[str] = field(default_factory=list)  # data files of a kind moetune reads not

    @property
    def mixed(self) -> bool:
        """Data files of more than one kind: what datasets alone would read in part."""
        return len(set(self.by_builder) | {kind(f) for f in self.unread}) > 1


def _module_of(suffix: str) -> str | None:
    """The datasets module that would read files of `suffix` (None: not a data file)."""
    # lazy: heavy to import (datasets)
    from datasets.packaged_modules import _EXTENSION_TO_MODULE

    found = _EXTENSION_TO_MODULE.get(suffix) or _EXTENSION_TO_MODULE.get(suffix.upper())
    return found[0] if found else None


def sorted_files(files: list[str]) -> DirFiles:
    """`files` by the builder that reads them; data files of other kinds apart."""
    out = DirFiles()
    for name in sorted(files):
        builder = BUILDERS.get(kind(name))
        if builder is not None:
            out.by_builder.setdefault(builder, []).append(name)
        elif _module_of(kind(name)) not in (None, *NOT_ROWS):
            out.unread.append(name)
    return out


def split_files(root: Path, split: str, guarded: Callable[[Callable[[], Any]], Any]) -> DirFiles:
    """The data files of `split` under `root`, sorted (datasets' own split patterns:
    train-*.parquet, data/train/…; `guarded` turns its errors into one line)."""
    # lazy: heavy to import (datasets)
    from datasets.data_files import DataFilesDict, get_data_patterns

    found = guarded(lambda: DataFilesDict.from_patterns(get_data_patterns(str(root)), str(root)))
    return sorted_files([str(f) for f in found.get(split, [])])


def refuse_unread(lab: str, root: Path, got: DirFiles) -> None:
    """Every data file of a source is read, or the ones left out are named."""
    if not got.unread:
        return
    names = ", ".join(os.path.relpath(f, root.resolve()) for f in got.unread[:4])
    more = f" and {len(got.unread) - 4} more" if len(got.unread) > 4 else ""
    raise DataError(
        f"source {lab}: {names}{more} would not be read (moetune reads "
        f"{', '.join(BUILDERS)} files of a directory)",
        f"convert them to .jsonl or .parquet, or move them out of {root}",
    )
