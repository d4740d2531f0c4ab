"""Training data in TRL's conventions, from local JSONL, JSON or Parquet files.

Every row is read and checked before anything is trained or written. The format is
detected from the first row (`FORMATS`, a registry in detection order) and every other
row must have the same one; an error names the file and the line (JSONL, JSON) or row
(Parquet), says what is wrong and how to fix it.

    messages            {"messages": [{"role": "user", "content": ...}, ...]}
    prompt/completion   {"prompt": ..., "completion": ...}   (strings or message lists)
    text                {"text": ...}

Completion-only loss where the format allows it: prompt/completion rows train on the
completion, messages rows on the assistant turns when the chat template marks them
(`{% generation %}`), text rows on every token. The choice is recorded with the run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from moetune.io import sha256_file
from moetune.train.errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

    from moetune.config import DataArgs

Row = dict[str, Any]
Overlong = Literal["truncate", "error"]
ROLES = ("system", "user", "assistant", "tool")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


# ---------------------------------------------------------------- readers, by suffix


def _bad_json(path: Path, line: int, exc: json.JSONDecodeError) -> DataError:
    return DataError(
        f"{path} line {line}: not valid JSON ({exc.msg}); nothing was trained",
        "fix or remove that line: each row must be one JSON object",
    )


def _read_jsonl(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"line {n}", json.loads(line)
        except json.JSONDecodeError as exc:
            raise _bad_json(path, n, exc) from None


def _read_json(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    """A JSON array of rows; anything else is read as JSON Lines (a common .json misnomer)."""
    if not text.lstrip().startswith("["):
        yield from _read_jsonl(path, text)
        return
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad_json(path, exc.lineno, exc) from None
    for n, row in enumerate(rows, 1):
        yield f"row {n}", row


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}: not UTF-8 text (byte {exc.start})", "save the file as UTF-8 JSON Lines"
        ) from None


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{path}: not a readable Parquet file ({first})", "rewrite it") from None
    for n, row in enumerate(table.to_pylist(), 1):
        yield f"row {n}", row


READERS: dict[str, Callable[[Path], Iterator[tuple[str, Any]]]] = {
    ".jsonl": lambda p: _read_jsonl(p, _read_text(p)),
    ".json": lambda p: _read_json(p, _read_text(p)),
    ".parquet": _read_parquet,
}


def read_rows(path: Path) -> list[tuple[str, Any]]:
    """(where, row) for every row of a data file; DataError when missing, unknown or empty."""
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(
            f"{path}: unknown data file type {path.suffix!r}",
            f"use one of {', '.join(READERS)} (TRL row conventions)",
        )
    if path.is_dir():
        raise DataError(f"{path} is a directory, not a data file", "name the file inside it")
    if not path.is_file():
        raise DataError(f"data file {path} not found", "check data.train_file / data.eval_file")
    rows = list(reader(path))
    if not rows:
        raise DataError(f"{path} is empty: no rows", "add rows (one JSON object each)")
    return rows


# ---------------------------------------------------------------- formats


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            for m in value
        )
    )


def _check_messages(row: Row) -> str | None:
    turns = row["messages"]
    if not _is_messages(turns):
        roles = ", ".join(ROLES)
        return f"'messages' must be a non-empty list of {{role, content}} objects ({roles})"
    if not any(m["role"] == "assistant" for m in turns):
        return "'messages' has no assistant turn, so there is nothing to learn"
    return None


def _check_prompt_completion(row: Row) -> str | None:
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return None if completion else "'completion' is empty"
    if _is_messages(prompt) and _is_messages(completion):
        return None
    return "'prompt' and 'completion' must both be strings or both be message lists"


def _check_text(row: Row) -> str | None:
    text = row["text"]
    return None if isinstance(text, str) and text.strip() else "'text' must be a non-empty string"


def _check_preference(row: Row) -> str | None:
    prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        return "'chosen' and 'rejected' are the same" if chosen == rejected else None
    if all(_is_messages(v) for v in (prompt, chosen, rejected)):
        return None
    return "'prompt', 'chosen' and 'rejected' must all be strings or all be message lists"


def _check_prompt(row: Row) -> str | None:
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return None if prompt else "'prompt' is empty"
    return None if _is_messages(prompt) else "'prompt' must be a string or a message list"


def _has_generation_tags(tok: PreTrainedTokenizerBase) -> bool:
    template = tok.chat_template if isinstance(tok.chat_template, str) else ""
    return bool(_GENERATION_TAG.search(template))


@dataclass(frozen=True)
class Loss:
    """Where the loss goes, as SFTConfig fields and in words."""

    sft: dict[str, Any]
    on: str


def _messages_loss(completion_only: bool, tok: PreTrainedTokenizerBase) -> Loss:
    if not completion_only:
        return Loss({"assistant_only_loss": False}, "all tokens (data.completion_only_loss off)")
    if _has_generation_tags(tok):
        return Loss({"assistant_only_loss": True}, "assistant turns")
    # TRL can only mask assistant turns through the template's generation markers
    return Loss(
        {"assistant_only_loss": False},
        "all tokens (the chat template has no {% generation %} markers)",
    )


def _prompt_completion_loss(completion_only: bool, tok: PreTrainedTokenizerBase) -> Loss:
    on = "completion tokens" if completion_only else "all tokens (data.completion_only_loss off)"
    return Loss({"completion_only_loss": completion_only}, on)


def _text_loss(completion_only: bool, tok: PreTrainedTokenizerBase) -> Loss:
    return Loss({"completion_only_loss": False}, "all tokens (text rows have no completion)")


def _preference_loss(completion_only: bool, tok: PreTrainedTokenizerBase) -> Loss:
    return Loss({}, "chosen vs rejected completions (DPO)")


def _prompt_loss(completion_only: bool, tok: PreTrainedTokenizerBase) -> Loss:
    return Loss({}, "sampled completions, weighted by their rewards (GRPO)")


def _chat_ids(tok: PreTrainedTokenizerBase, turns: list[Row]) -> list[int]:
    out: Any = tok.apply_chat_template(turns, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # a BatchEncoding in v5


def _text_ids(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids: list[int] = tok(text, add_special_tokens=False)["input_ids"]
    return [*ids, tok.eos_token_id] if tok.eos_token_id is not None else ids


def _pc_length(row: Row, tok: PreTrainedTokenizerBase) -> int:
    if isinstance(row["prompt"], str):
        return len(_text_ids(tok, row["prompt"] + row["completion"]))
    return len(_chat_ids(tok, row["prompt"] + row["completion"]))


def _ids(row: Row, tok: PreTrainedTokenizerBase, *keys: str) -> int:
    """Tokens of the row's `keys` joined (text) or concatenated (message lists)."""
    if isinstance(row[keys[0]], str):
        return len(_text_ids(tok, "".join(row[k] for k in keys)))
    return len(_chat_ids(tok, [m for k in keys for m in row[k]]))


def _preference_length(row: Row, tok: PreTrainedTokenizerBase) -> int:
    return max(_ids(row, tok, "prompt", "chosen"), _ids(row, tok, "prompt", "rejected"))


def _uses_chat(row: Row) -> bool:
    """Rows rendered through the chat template: messages, or prompt/completion as turns."""
    return "messages" in row or ("prompt" in row and not isinstance(row["prompt"], str))


@dataclass(frozen=True)
class DataFormat:
    """One TRL row convention: its keys, a row check, the loss it allows, its token length."""

    name: str
    keys: tuple[str, ...]
    check: Callable[[Row], str | None]  # what is wrong with a row of this format, or None
    loss: Callable[[bool, PreTrainedTokenizerBase], Loss]
    length: Callable[[Row, PreTrainedTokenizerBase], int]
    extras: bool = False  # keep the row's other columns (GRPO rewards read them)


FORMATS: dict[str, DataFormat] = {
    f.name: f
    for f in (
        DataFormat("messages", ("messages",), _check_messages, _messages_loss,
                   lambda r, t: len(_chat_ids(t, r["messages"]))),
        DataFormat("prompt/completion", ("prompt", "completion"), _check_prompt_completion,
                   _prompt_completion_loss, _pc_length),
        DataFormat("text", ("text",), _check_text, _text_loss,
                   lambda r, t: len(_text_ids(t, r["text"]))),
        DataFormat("preference", ("prompt", "chosen", "rejected"), _check_preference,
                   _preference_loss, _preference_length),
        # last: any row with a prompt matches it; GRPO keeps the other columns for rewards
        DataFormat("prompt", ("prompt",), _check_prompt, _prompt_loss,
                   lambda r, t: _ids(r, t, "prompt"), extras=True),
    )
}  # fmt: skip


SFT_FORMATS = ("messages", "prompt/completion", "text")  # what train.method sft reads


def _format_of(row: Row, allowed: tuple[str, ...] = SFT_FORMATS) -> DataFormat | None:
    """The first allowed format whose keys the row has (FORMATS' order decides)."""
    candidates = (f for f in FORMATS.values() if f.name in allowed)
    return next((f for f in candidates if all(k in row for k in f.keys)), None)


def _expected(allowed: tuple[str, ...] = SFT_FORMATS) -> str:
    return " | ".join("+".join(FORMATS[name].keys) for name in allowed)


def detect_format(
    path: Path, where: str, row: Any, allowed: tuple[str, ...] = SFT_FORMATS
) -> DataFormat:
    """The format of a file from its first row; DataError naming the keys when none fits."""
    if not isinstance(row, dict):
        raise DataError(
            f"{path} {where}: a row must be a JSON object, got {type(row).__name__}",
            f"write one object per row with keys {_expected(allowed)}",
        )
    fmt = _format_of(row, allowed)
    if fmt is None:
        keys = ", ".join(sorted(row)) or "none"
        other = _format_of(row, tuple(FORMATS))
        what = f"{other.name} rows, not for this train.method" if other else "unknown data format"
        raise DataError(
            f"{path} {where}: {what} (keys: {keys})",
            f"use TRL's row conventions for this method: {_expected(allowed)}",
        )
    return fmt


def check_row(path: Path, where: str, row: Any, fmt: DataFormat, columns: Any = None) -> Row:
    """The row, or DataError saying what is wrong with it (missing keys, mixed formats, types)."""
    if not isinstance(row, dict):
        raise DataError(f"{path} {where}: not a JSON object", f"write {fmt.name} rows")
    missing = [k for k in fmt.keys if k not in row]
    if missing:
        other = _format_of(row)
        cause = (
            f"{path} {where}: a {other.name} row in a {fmt.name} file (the first row decides)"
            if other is not None
            else f"{path} {where}: missing {', '.join(map(repr, missing))} "
            f"({fmt.name} rows need {', '.join(fmt.keys)})"
        )
        raise DataError(cause, f"give every row the keys {', '.join(fmt.keys)}")
    problem = fmt.check(row) or _column_problem(row, fmt, columns)
    if problem:
        raise DataError(f"{path} {where}: {problem}", f"fix that row ({fmt.name} format)")
    keys = sorted(row) if fmt.extras else fmt.keys
    return {k: _plain(row[k]) if k in fmt.keys else row[k] for k in keys}


def _column_problem(row: Row, fmt: DataFormat, columns: Any) -> str | None:
    """Rows that keep extra columns must all have the first row's (`datasets` needs one
    schema)."""
    if not fmt.extras or columns is None or set(row) == set(columns):
        return None
    missing = sorted(set(columns) - set(row)) or sorted(set(row) - set(columns))
    return f"columns differ from the first row's ({', '.join(missing)})"


def _plain(value: Any) -> Any:
    """Messages keep only role and content, so every row has the same schema in `datasets`."""
    if isinstance(value, list):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    return value


# ---------------------------------------------------------------- the training set


@dataclass(frozen=True)
class TrainData:
    """Checked rows of one file, as a `datasets.Dataset`, with what the loss is taken on."""

    path: Path
    format: str
    dataset: Dataset
    loss: Loss
    overlong: int  # rows longer than the sequence length (TRL truncates them)
    sha256: str

    @property
    def rows(self) -> int:
        return len(self.dataset)

    def to_json(self) -> dict[str, Any]:
        return {
            "file": str(self.path),
            "format": self.format,
            "rows": self.rows,
            "loss_on": self.loss.on,
            "overlong_rows_truncated": self.overlong,
            "sha256": self.sha256,
        }


def _needs_template(path: Path, fmt: DataFormat, first: Row, tok: PreTrainedTokenizerBase) -> None:
    if _uses_chat(first) and not tok.chat_template:
        raise DataError(
            f"{path}: {fmt.name} rows with message lists need a chat template; "
            "the tokenizer has none",
            "use prompt/completion or text rows, or a tokenizer that ships a chat template",
        )


def _count_overlong(
    path: Path, rows: list[tuple[str, Row]], fmt: DataFormat, tok: Any, seq_len: int, policy: str
) -> int:
    count = 0
    for where, row in rows:
        length = fmt.length(row, tok)
        if length <= seq_len:
            continue
        if policy == "error":
            raise DataError(
                f"{path} {where}: {length} tokens, longer than train.seq_len={seq_len}",
                "shorten the row, raise train.seq_len, or set data.overlong=truncate",
            )
        count += 1
    return count


def read_checked(
    path: Path, allowed: tuple[str, ...] = SFT_FORMATS
) -> tuple[DataFormat, list[tuple[str, Row]]]:
    """Every row of a data file, read and checked against the format its first row sets
    (no tokenizer needed: a malformed row fails in milliseconds, before any model loads)."""
    located = read_rows(path)
    fmt = detect_format(path, *located[0], allowed)
    first = located[0][1]
    return fmt, [(where, check_row(path, where, row, fmt, first)) for where, row in located]


def load_data(
    file: str | Path,
    tok: PreTrainedTokenizerBase,
    seq_len: int,
    completion_only: bool = True,
    overlong: Overlong = "truncate",
    allowed: tuple[str, ...] = SFT_FORMATS,
) -> TrainData:
    """Read and check every row of `file`, then build the dataset TRL trains on."""
    # lazy: heavy to import (datasets)
    from datasets import Dataset

    path = Path(file)
    fmt, rows = read_checked(path, allowed)
    _needs_template(path, fmt, rows[0][1], tok)
    too_long = _count_overlong(path, rows, fmt, tok, seq_len, overlong)
    dataset = Dataset.from_list([row for _, row in rows])
    return TrainData(
        path, fmt.name, dataset, fmt.loss(completion_only, tok), too_long, sha256_file(path)
    )


def load_train_data(
    data: DataArgs, tok: PreTrainedTokenizerBase, seq_len: int,
    allowed: tuple[str, ...] = SFT_FORMATS,
) -> tuple[TrainData, TrainData | None]:  # fmt: skip
    """The training set and the optional eval set (same format) of a run config; `allowed`:
    the formats the run's train.method reads."""
    if not data.train_file:
        raise DataError(
            "data.train_file is not set: nothing to train on",
            "set data.train_file (or --set data.train_file=path/to/train.jsonl)",
        )
    policy: Overlong = data.overlong
    only = data.completion_only_loss
    train = load_data(data.train_file, tok, seq_len, only, policy, allowed)
    if not data.eval_file:
        return train, None
    held_out = load_data(data.eval_file, tok, seq_len, only, policy, allowed)
    if held_out.format != train.format:
        raise DataError(
            f"{data.eval_file} holds {held_out.format} rows but {data.train_file} {train.format}",
            "give the eval file the same row format as the training file",
        )
    return train, held_out
