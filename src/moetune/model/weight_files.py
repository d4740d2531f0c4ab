"""A local base's weight files, checked before anything is built or written.

A safetensors file is an 8-byte little-endian header length, a JSON header (dtype, shape,
data_offsets of every tensor) and the raw bytes. A file cut short by a copy, a header
overwritten, or a shard an index names but the folder lacks would otherwise surface as a
loader's traceback after the run dir was started; here it is one line naming the file.
Only headers are read (a few MB for the largest bases), never the tensors.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from moetune.errors import ModelSourceError, clip, os_problem

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
FIX = "re-download or re-save the base (save_pretrained), and keep it in place while it is used"


class WeightFileError(ModelSourceError):
    """A base's weight file is missing, cut short or not safetensors."""


def _damaged(path: Path, why: str) -> WeightFileError:
    return WeightFileError(f"base weights {clip(path, 100)} are damaged: {why}", FIX)


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(the JSON header of one safetensors file, where its data starts), each tensor's
    data_offsets checked to lie inside the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < length <= size - 8:
                raise _damaged(path, f"its header length does not fit its {size} bytes")
            header = json.loads(fh.read(length))
    except OSError as exc:
        raise WeightFileError(f"base weights {clip(path, 100)}: {os_problem(exc)}", FIX) from None
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        raise _damaged(path, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise _damaged(path, "its header is not a table of tensors")
    for key, info in header.items():
        if key != "__metadata__" and not _inside(info, size - 8 - length):
            raise _damaged(path, f"tensor {clip(key, 60)} lies past the file's end")
    return header, 8 + length


def _inside(info: Any, data_bytes: int) -> bool:
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2):
        return False
    start, end = offsets
    return isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= data_bytes


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The files that make a local base's checkpoint, decided here once for every loader: the
    shards its index names when it has one, else model.safetensors, else every *.safetensors.
    Any other weight file in the dir (a stale float model.safetensors beside an FP8 release's
    shards) is not read: read too, its bytes would replace the same keys' and train garbage."""
    folder = Path(model_dir)
    if (folder / INDEX).is_file():
        return [folder / name for name in sorted(_shards(folder / INDEX))]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    return sorted(folder.glob("*.safetensors"))


def ignored_files(model_dir: str | Path) -> list[Path]:
    """The *.safetensors files in a base's dir that are not part of its checkpoint."""
    keep = set(checkpoint_files(model_dir))
    return [p for p in sorted(Path(model_dir).glob("*.safetensors")) if p not in keep]


def check_weight_files(model_dir: str | Path | None, own_reader: bool = False) -> list[str]:
    """Every file of a local base's checkpoint present, its header readable and whole, and no
    tensor in two of them; a note naming each other weight file in the dir (not read).
    `own_reader`: moetune's loaders read the files (checkpoint_files), not transformers'
    from_pretrained, which reads a model.safetensors ahead of an index that does not name it.
    Nothing to check for a hub id (None) or a GGUF / .bin base."""
    if model_dir is None or not Path(model_dir).is_dir():
        return []
    folder, seen = Path(model_dir), dict[str, Path]()
    if not own_reader and (folder / SINGLE) in ignored_files(folder):
        raise _shadowing(folder)
    for path in checkpoint_files(folder):
        if not path.is_file():
            raise _damaged(path, f"{INDEX} names it but it is not there")
        keys = read_header(path)[0].keys() - {"__metadata__"}
        refuse_twice(seen.keys() & keys, seen.__getitem__, path)
        seen.update(dict.fromkeys(keys, path))
    return [_ignored_note(p) for p in ignored_files(folder)]


def refuse_twice(both: Iterable[str], first_file: Callable[[str], Path], second: Path) -> None:
    """A tensor in two files of one checkpoint: which bytes would load depends on the reader."""
    key = min(both, default=None)
    if key is not None:
        raise WeightFileError(
            f"tensor {clip(key, 60)} is in two files of the base, {clip(first_file(key).name, 60)} "
            f"and {clip(second.name, 60)}: which of them holds its weights is not decidable",
            "re-download or re-save the base (save_pretrained): each tensor is in one shard",
        )


def _shadowing(folder: Path) -> WeightFileError:
    return WeightFileError(
        f"{clip(folder / SINGLE, 100)} lies beside {INDEX}, which does not name it: transformers "
        "would load it instead of the index's shards",
        f"move the stale one out of the base's dir ({SINGLE}, or {INDEX} and its shards)",
    )


def _ignored_note(path: Path) -> str:
    made_of = f"{INDEX} names its shards" if (path.parent / INDEX).is_file() else SINGLE
    return (f"ignored {clip(path, 100)}: not part of the base's checkpoint ({made_of}); "
            "move it out of the base's dir if it is stale")  # fmt: skip


def _shards(index: Path) -> set[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError):
        raise _damaged(index, "it is not a JSON index with a weight_map") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise _damaged(index, "it has no weight_map")
    if not all(isinstance(v, str) and v == Path(v).name for v in weight_map.values()):
        raise _damaged(index, "its weight_map names a file outside the base's dir")
    return set(weight_map.values())
