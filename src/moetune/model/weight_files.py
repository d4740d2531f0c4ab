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


def check_weight_files(model_dir: str | Path | None) -> None:
    """Every *.safetensors header of a local base readable and whole, and every shard its
    index names present; nothing to check for a hub id (None) or a GGUF / .bin base."""
    if model_dir is None or not Path(model_dir).is_dir():
        return
    folder = Path(model_dir)
    for path in sorted(folder.glob("*.safetensors")):
        read_header(path)
    index = folder / INDEX
    if index.is_file() and not (folder / SINGLE).is_file():  # read first
        for name in sorted(_shards(index)):
            if not (folder / name).is_file():
                raise _damaged(folder / name, f"{INDEX} names it but it is not there")


def _shards(index: Path) -> set[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError):
        raise _damaged(index, "it is not a JSON index with a weight_map") from None
    if not isinstance(weight_map, dict):
        raise _damaged(index, "it has no weight_map")
    return {str(v) for v in weight_map.values()}
