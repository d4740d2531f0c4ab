"""One source of data.sources read into rows, whatever it is:

    a .jsonl / .json / .parquet file   files.py, row by row (errors name the line)
    a .csv / .arrow file               datasets' csv / arrow builders
    a dir saved with save_to_disk      datasets.load_from_disk (a DatasetDict: its `split`)
    any other dir                      every json / parquet / csv / arrow file of its split
                                       (dirs.py: a mixed dir is read whole, other data named)
    owner/name                         datasets.load_dataset(hub id, name, split): the hub, or
                                       its local cache when HF_HUB_OFFLINE=1

Every failure is a DataError naming the source. With data.streaming the rows are read lazily
(datasets' IterableDataset), for sets larger than RAM.
"""

from __future__ import annotations

import atexit
import functools
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.data.columns import duplicate_key, refuse_duplicate_columns
from moetune.data.dirs import BUILDERS, refuse_unread, split_files
from moetune.data.errors import DataError
from moetune.data.files import READERS, read_rows, refuse_special
from moetune.io import quiet_logger, unwritable

if TYPE_CHECKING:
    from moetune.config import SourceArgs

Located = tuple[str, Any]  # (where in the source, the row as read)
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # save_to_disk's files


def label(src: SourceArgs) -> str:
    """How errors and summaries name a source: its path, with subset and split if set."""
    extra = "/".join(p for p in (src.name, None if src.split == "train" else src.split) if p)
    return f"{src.path} [{extra}]" if extra else src.path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _numbered(parts: Sequence[tuple[str, Iterable[Any]]]) -> Iterator[Located]:
    """Rows numbered within each part ("row 3", or "(json files) row 3" in a mixed dir)."""
    with quiet_json_reader():  # a streamed source is read here, past _guarded
        for tag, rows in parts:
            yield from ((f"{tag}row {n}", row) for n, row in enumerate(rows, 1))


def _split_of(found: Any, src: SourceArgs) -> Any:
    """The configured split of a DatasetDict (or the dataset itself)."""
    if not hasattr(found, "keys"):  # one Dataset saved alone: it has no splits to pick from
        if src.split != "train":
            raise DataError(
                f"source {label(src)}: a dataset saved alone has no splits, so split "
                f"{src.split!r} cannot apply",
                "drop split: from that source (or save a DatasetDict with that split)",
            )
        return found
    if src.split not in found:
        raise DataError(
            f"source {label(src)}: no split {src.split!r} (splits: {', '.join(found)})",
            "set split: to one of those in data.sources",
        )
    return found[src.split]


# datasets' json reader logs each unparsable file at ERROR before it raises: on stderr, a
# line with no fix beside (or, after lint's report, instead of) the DataError naming it
JSON_LOGGER = "datasets.packaged_modules.json.json"


def quiet_json_reader() -> AbstractContextManager[None]:
    return quiet_logger(JSON_LOGGER, logging.CRITICAL)


def _guarded(src: SourceArgs, load: Callable[[], Any]) -> Any:
    """datasets' loading errors, as one line naming the source."""
    # lazy: heavy to import (datasets)
    from datasets.exceptions import DatasetNotFoundError, DatasetsError

    try:
        with quiet_json_reader():
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
    except StopIteration:  # datasets' streamed json reader peeks a first table: none there
        raise DataError(
            f"source {label(src)}: holds no rows datasets can read (empty, or no JSON rows)",
            "check the file: one JSON object a line (or a json / parquet / csv / arrow file)",
        ) from None
    except (DatasetsError, OSError, ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise unreadable(src, exc) from None


def unreadable(src: SourceArgs, exc: BaseException) -> DataError:
    """What datasets could not read, in one line: a key twice in a row named as such."""
    why = exc.__cause__ or exc  # DatasetGenerationError says only "an error occurred"
    if (twice := duplicate_key(label(src), why)) is not None:
        return twice
    return DataError(
        f"source {label(src)}: cannot be read ({_first_line(why)})",
        "check the files are valid json / parquet / csv / arrow, and the name and split",
    )


def _streamed(src: SourceArgs) -> Iterator[Located]:
    """The streamed rows; a file datasets fails to parse while they are read (a streamed
    json file is parsed here, past _guarded: ArrowInvalid, a ValueError) named as _guarded
    names it."""
    rows = _numbered(_parts(src, streaming=True))
    while True:
        try:
            item = next(rows)
        except StopIteration:
            return
        except DataError:
            raise
        except (OSError, ValueError, TypeError, KeyError, RuntimeError) as exc:
            raise unreadable(src, exc) from None
        yield item


def _load_dataset(src: SourceArgs, streaming: bool, *args: Any, **kw: Any) -> Any:
    # lazy: heavy to import (datasets)
    from datasets import load_dataset

    kw = {**kw, **_cache_dir(src, hub=args[0] == src.path and not Path(src.path).exists())}
    return _guarded(src, lambda: load_dataset(*args, split=src.split, streaming=streaming, **kw))


def _cache_dir(src: SourceArgs, hub: bool) -> dict[str, str]:
    """datasets' cache where it can be written (HOME read-only, HF_DATASETS_CACHE on a
    read-only mount): a local file's arrow copy goes to a temp dir removed at exit, so the
    run goes on; a hub dataset lives in that cache, so its source is refused in one line."""
    # lazy: heavy to import (datasets)
    from datasets import config

    cache = Path(config.HF_DATASETS_CACHE)
    why = unwritable(cache)
    if why is None:
        return {}
    if hub:
        raise DataError(
            f"source {label(src)}: the datasets cache {cache} cannot be written ({why})",
            "set HF_DATASETS_CACHE (or HF_HOME) to a writable dir",
        )
    return {"cache_dir": _temp_cache()}


@functools.cache
def _temp_cache() -> str:
    """One temp datasets cache a process, removed when it exits."""
    path = tempfile.mkdtemp(prefix="moetune-datasets-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _saved(src: SourceArgs, path: Path, streaming: bool) -> Any:
    # lazy: heavy to import (datasets)
    from datasets import load_from_disk

    found = _split_of(_guarded(src, lambda: load_from_disk(str(path))), src)
    return found.to_iterable_dataset() if streaming else found


def _one_file(src: SourceArgs, path: Path) -> None:
    """A single file has no splits or subsets: a split or name set on one would be ignored."""
    if src.split != "train" or src.name:
        what = f"split {src.split!r}" if src.split != "train" else f"name {src.name!r}"
        raise DataError(
            f"source {path} is one file: it has no splits or subsets, so {what} cannot apply",
            "drop split: / name: from that source (or point path at a dir or hub dataset)",
        )


def _file(src: SourceArgs, path: Path, streaming: bool) -> Any:
    _one_file(src, path)
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(
            f"source {path}: unknown data file type {path.suffix!r}",
            f"use one of {', '.join(BUILDERS)}, a directory of them, or a hub dataset id",
        )
    refuse_duplicate_columns(path)
    kw = {"data_files": str(path)}
    return _load_dataset(src.model_copy(update={"split": "train"}), streaming, builder, **kw)


def _folder(src: SourceArgs, path: Path, streaming: bool) -> list[tuple[str, Any]]:
    """A dir's data files of the split: every kind read (datasets alone reads the most common
    kind only), data files of other kinds refused by name. A named subset is datasets' own."""
    if src.name:
        return [("", _load_dataset(src, streaming, str(path), src.name))]
    got = split_files(path, src.split, lambda load: _guarded(src, load))
    refuse_unread(label(src), path, got)  # a dir of .txt alone too: datasets reads it as lines
    for name in (f for files in got.by_builder.values() for f in files):
        refuse_duplicate_columns(Path(name))
    if not got.mixed:  # one kind (or none: datasets says what is missing)
        return [("", _load_dataset(src, streaming, str(path), src.name))]
    one = src.model_copy(update={"split": "train"})  # data_files given: all in datasets' train
    return [(f"({builder} files) ", _load_dataset(one, streaming, builder, data_files=files))
            for builder, files in got.by_builder.items()]  # fmt: skip


def _parts(src: SourceArgs, streaming: bool) -> list[tuple[str, Any]]:
    """The source as datasets Datasets / IterableDatasets: one, or one per kind of file in a
    mixed dir, each with the tag its rows are named by."""
    path = Path(src.path).expanduser()
    if path.is_dir() and any((path / m).is_file() for m in SAVED_MARKERS):
        return [("", _saved(src, path, streaming))]
    if path.is_dir():
        return _folder(src, path, streaming)
    if path.is_file():
        return [("", _file(src, path, streaming))]
    refuse_special(path)
    if path.suffix.lower() in BUILDERS or src.path.count("/") != 1:  # a file path, not owner/name
        raise DataError(f"source {src.path} not found", "check data.sources[].path / train_file")
    return [("", _load_dataset(src, streaming, src.path, src.name))]


def _head(found: Any, limit: int | None) -> list[Any]:
    count = min(len(found), limit or len(found))
    return list(found.select(range(count)).to_list())


def read_source(src: SourceArgs) -> list[Located]:
    """Every row of a source (its first max_rows), numbered; DataError when missing or empty."""
    path = Path(src.path).expanduser()
    if path.is_file() and path.suffix.lower() in READERS:  # read here: errors name the line
        _one_file(src, path)
        rows = read_rows(path)
    else:
        parts = [(tag, _head(found, src.max_rows)) for tag, found in _parts(src, False)]
        rows = list(_numbered(parts))
    rows = rows[: src.max_rows] if src.max_rows else rows
    if not rows:
        raise DataError(f"source {label(src)} is empty: no rows to train on", "add rows to it")
    return rows


def stream_source(src: SourceArgs) -> Iterator[Located]:
    """The source's rows read lazily (data.streaming), its first max_rows."""
    return islice(_streamed(src), src.max_rows)
