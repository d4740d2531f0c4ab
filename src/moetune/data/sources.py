"""One source of data.sources read into rows, whatever it is:

    a .jsonl / .json / .parquet file   files.py, row by row (errors name the line)
    a .csv / .arrow file               datasets' csv / arrow builders
    a dir saved with save_to_disk      datasets.load_from_disk (a DatasetDict: its `split`)
    any other dir                      datasets.load_dataset(dir): its json / parquet / csv files
    owner/name                         datasets.load_dataset(hub id, name, split): the hub, or
                                       its local cache when HF_HUB_OFFLINE=1

Every failure is a DataError naming the source. With data.streaming the rows are read lazily
(datasets' IterableDataset), for sets larger than RAM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.data.errors import DataError
from moetune.data.files import READERS, read_rows

if TYPE_CHECKING:
    from moetune.config import SourceArgs

Located = tuple[str, Any]  # (where in the source, the row as read)
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # save_to_disk's files
BUILDERS = {".csv": "csv", ".arrow": "arrow", ".jsonl": "json", ".json": "json",
            ".parquet": "parquet"}  # fmt: skip


def label(src: SourceArgs) -> str:
    """How errors and summaries name a source: its path, with subset and split if set."""
    extra = "/".join(p for p in (src.name, None if src.split == "train" else src.split) if p)
    return f"{src.path} [{extra}]" if extra else src.path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _numbered(rows: Iterable[Any]) -> Iterator[Located]:
    return ((f"row {n}", row) for n, row in enumerate(rows, 1))


def _split_of(found: Any, src: SourceArgs) -> Any:
    """The configured split of a DatasetDict (or the dataset itself)."""
    if not hasattr(found, "keys"):
        return found
    if src.split not in found:
        raise DataError(
            f"source {label(src)}: no split {src.split!r} (splits: {', '.join(found)})",
            "set split: to one of those in data.sources",
        )
    return found[src.split]


def _guarded(src: SourceArgs, load: Callable[[], Any]) -> Any:
    """datasets' loading errors, as one line naming the source."""
    # lazy: heavy to import (datasets)
    from datasets.exceptions import DatasetNotFoundError, DatasetsError

    try:
        return load()
    except DataError:
        raise
    except DatasetNotFoundError:
        raise DataError(
            f"source {src.path!r} not found: no such local path, and no hub dataset of that "
            "name is reachable (or in the local cache, when offline)",
            "check data.sources[].path (a file, a directory, or owner/name on the hub)",
        ) from None
    except ConnectionError:  # offline, or the hub is unreachable, and it is not cached
        raise DataError(
            f"source {src.path!r} not found: no such local path, the hub is unreachable "
            "(offline?) and the local dataset cache has no copy",
            "check data.sources[].path, or load it once online (it is cached for offline runs)",
        ) from None
    except (DatasetsError, OSError, ValueError, TypeError, KeyError, RuntimeError) as exc:
        why = exc.__cause__ or exc  # DatasetGenerationError says only "an error occurred"
        raise DataError(
            f"source {label(src)}: cannot be read ({_first_line(why)})",
            "check the files are valid json / parquet / csv / arrow, and the name and split",
        ) from None


def _load_dataset(src: SourceArgs, streaming: bool, *args: Any, **kw: Any) -> Any:
    # lazy: heavy to import (datasets)
    from datasets import load_dataset

    return _guarded(src, lambda: load_dataset(*args, split=src.split, streaming=streaming, **kw))


def _saved(src: SourceArgs, path: Path, streaming: bool) -> Any:
    # lazy: heavy to import (datasets)
    from datasets import load_from_disk

    found = _split_of(_guarded(src, lambda: load_from_disk(str(path))), src)
    return found.to_iterable_dataset() if streaming else found


def _file(src: SourceArgs, path: Path, streaming: bool) -> Any:
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(
            f"source {path}: unknown data file type {path.suffix!r}",
            f"use one of {', '.join(BUILDERS)}, a directory of them, or a hub dataset id",
        )
    kw = {"data_files": str(path)}
    return _load_dataset(src.model_copy(update={"split": "train"}), streaming, builder, **kw)


def _dataset(src: SourceArgs, streaming: bool) -> Any:
    """The source as a datasets Dataset / IterableDataset."""
    path = Path(src.path).expanduser()
    if path.is_dir() and any((path / m).is_file() for m in SAVED_MARKERS):
        return _saved(src, path, streaming)
    if path.is_dir():
        return _load_dataset(src, streaming, str(path), src.name)
    if path.is_file():
        return _file(src, path, streaming)
    if path.suffix.lower() in BUILDERS or src.path.count("/") != 1:  # a file path, not owner/name
        raise DataError(f"source {src.path} not found", "check data.sources[].path / train_file")
    return _load_dataset(src, streaming, src.path, src.name)


def read_source(src: SourceArgs) -> list[Located]:
    """Every row of a source (its first max_rows), numbered; DataError when missing or empty."""
    path = Path(src.path).expanduser()
    if path.is_file() and path.suffix.lower() in READERS:  # read here: errors name the line
        rows = read_rows(path)
    else:
        found = _dataset(src, streaming=False)
        count = min(len(found), src.max_rows or len(found))
        rows = list(_numbered(found.select(range(count)).to_list()))
    rows = rows[: src.max_rows] if src.max_rows else rows
    if not rows:
        raise DataError(f"source {label(src)} is empty: no rows to train on", "add rows to it")
    return rows


def stream_source(src: SourceArgs) -> Iterator[Located]:
    """The source's rows read lazily (data.streaming), its first max_rows."""
    return islice(_numbered(_dataset(src, streaming=True)), src.max_rows)
