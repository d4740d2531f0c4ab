"""Image+text rows for multimodal checkpoints, in the two common layouts:

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                               {"type": "text", "text": "What is it?"}]},
                  {"role": "assistant", "content": "A cat."}]}
    {"messages": [...plain string contents...], "images": ["cat.png"]}

An `images` column fills the rows' bare `{"type": "image"}` blocks in order or, with none,
goes before the first user turn's text (TRL's convention). Paths are resolved against the
data file's folder; every image is opened and decoded when the rows are checked, so a
missing or broken one stops the run before any model is built. A checked row holds its
turns as content blocks (`{"type": "image"}` placeholders) and `images`: absolute paths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from moetune.data.errors import DataError

Row = dict[str, Any]
Turns = list[dict[str, Any]]


def has_images(row: Row) -> bool:
    """Whether a raw or checked row carries images (an `images` column or image blocks)."""
    if row.get("images"):
        return True
    turns = row.get("messages")
    return isinstance(turns, list) and any(_image_blocks(t) for t in turns if isinstance(t, dict))


def _image_blocks(turn: dict[str, Any]) -> list[dict[str, Any]]:
    content = turn.get("content")
    if not isinstance(content, list):
        return []
    return [b for b in content if isinstance(b, dict) and b.get("type") == "image"]


def block_problem(content: list[Any]) -> str | None:
    """What is wrong with a list of content blocks, or None."""
    for n, block in enumerate(content, 1):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            continue
        if kind == "image" and isinstance(block.get("image", ""), str):
            continue
        return f"content block {n} is not {{type: text, text}} or {{type: image[, image: path]}}"
    return None


def block_text(content: Any) -> str:
    """A turn's text: the string itself, or its text blocks joined (images left out)."""
    if not isinstance(content, list):
        return content if isinstance(content, str) else ""
    return "".join(b["text"] for b in content if b.get("type") == "text")


def text_turns(turns: Turns) -> Turns:
    """The turns with block contents flattened to their text: what a tokenizer's own chat
    template renders (lengths, masks and samples of the text tokens)."""
    return [
        {**t, "content": block_text(t.get("content"))} if isinstance(t.get("content"), list) else t
        for t in turns
    ]


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return [dict(b) for b in content]
    return [{"type": "text", "text": content}] if isinstance(content, str) else []


def as_blocks(turns: Turns) -> Turns:
    """Every turn's content as a list of blocks (a processor's templates read those)."""
    return [{**t, "content": _blocks(t.get("content"))} for t in turns]


def _placed(turns: Turns, column: list[str]) -> tuple[Turns, list[str]]:
    """(turns as blocks with bare image placeholders, the images' paths in order)."""
    out = as_blocks(turns)
    blocks = [b for t in out for b in t["content"] if b["type"] == "image"]
    bare = [b for b in blocks if not b.get("image")]
    if column and not blocks:
        first = next((t for t in out if t["role"] == "user"), out[0])
        first["content"][:0] = [{"type": "image"} for _ in column]
        return out, list(column)
    if len(bare) != len(column):
        raise ValueError(f"{len(bare)} bare image blocks but {len(column)} entries in 'images'")
    fill, paths = iter(column), []
    for block in blocks:
        paths.append(block.pop("image", None) or next(fill))
    return out, paths


def _decoded(path: Path) -> str | None:
    """Why the image cannot be used, or None."""
    if path.is_dir():
        return "is a directory, not an image file"
    if not path.is_file():
        return "not found" if not path.exists() else "is not a regular file"
    try:
        with Image.open(path) as img:
            img.load()
    except Image.DecompressionBombError:  # not an OSError: Pillow's guard against huge images
        return (
            f"is over Pillow's limit of {Image.MAX_IMAGE_PIXELS:,} pixels (a decompression "
            "bomb, or an image no processor would take whole): downscale it"
        )
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        return f"cannot be decoded ({str(exc).splitlines()[0][:120] or type(exc).__name__})"
    return None


def with_images(lab: str, where: str, row: Row, folder: Path) -> Row:
    """A checked messages row with its images placed, resolved against `folder` and decoded;
    DataError naming the source, the row and the image otherwise."""
    column = row.get("images") or []
    column = [column] if isinstance(column, str) else column
    if not isinstance(column, list) or not all(isinstance(p, str) and p for p in column):
        raise DataError(
            f"{lab} {where}: 'images' must be a list of file paths",
            "write image paths relative to the data file",
        )
    try:
        turns, paths = _placed(row["messages"], column)
    except ValueError as exc:
        raise DataError(f"{lab} {where}: {exc}", "give one path per bare image block") from None
    resolved = []
    for name in paths:
        path = (folder / name).expanduser()
        problem = _decoded(path)
        if problem:
            raise DataError(
                f"{lab} {where}: image {name} {problem} (looked for {path})",
                "fix the path (relative to the data file) or the image file",
            )
        resolved.append(str(path.resolve()))
    return {"messages": turns, "images": resolved}


def image_counts(rows: list[Row]) -> dict[str, Any] | None:
    """Images per row ({count: rows}), their total and the rows that have any; None when no
    row has an image."""
    counts = [len(r.get("images") or []) for r in rows]
    if not any(counts):
        return None
    per_row = {str(n): counts.count(n) for n in sorted(set(counts))}
    return {
        "images": sum(counts),
        "rows_with_images": sum(c > 0 for c in counts),
        "per_row": per_row,
    }
