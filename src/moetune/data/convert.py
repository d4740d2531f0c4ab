"""A source's rows made into TRL's conventions: its `columns` renamed onto the format's
keys, then ShareGPT and Alpaca rows turned into messages (`CONVERTERS`, by source format).

    sharegpt   {"conversations": [{"from": "human" | "gpt" | "system" | "observation" |
                "function_call", "value": ...}], "system"?: ...}
    alpaca     {"instruction": ..., "input"?: ..., "output": ..., "system"?: ...}

A converter returns the new row, or a string saying what is wrong with the row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moetune.data.errors import DataError
from moetune.registry import Registry

Row = dict[str, Any]
Converter = Callable[[Row], "Row | str"]

# ShareGPT speakers as chat roles (LLaMA-Factory's dumps add observation / function_call)
SPEAKERS = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "system": "system", "tool": "tool", "observation": "tool", "function_call": "assistant",
}  # fmt: skip


def _same(row: Row) -> Row | str:
    return row


def _sharegpt(row: Row) -> Row | str:
    turns = row.get("conversations")
    if not isinstance(turns, list) or not turns:
        return "missing 'conversations' (a list of {from, value} turns)"
    messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    for n, turn in enumerate(turns, 1):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        if speaker not in SPEAKERS:
            return f"conversations turn {n} is from {speaker!r}; use one of {', '.join(SPEAKERS)}"
        messages.append({"role": SPEAKERS[speaker], "content": turn.get("value")})
    return {"messages": messages}


def _alpaca(row: Row) -> Row | str:
    missing = [k for k in ("instruction", "output") if not isinstance(row.get(k), str)]
    if missing:
        return f"missing {', '.join(map(repr, missing))} (alpaca rows need instruction, output)"
    ask = "\n\n".join(p for p in (row["instruction"], row.get("input") or "") if p)
    system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    turns = [{"role": "user", "content": ask}, {"role": "assistant", "content": row["output"]}]
    return {"messages": system + turns}


CONVERTERS: Registry[Converter] = Registry("data format", DataError)
for _name, _conv in (
    ("messages", _same), ("prompt_completion", _same), ("text", _same), ("preference", _same),
    ("sharegpt", _sharegpt), ("alpaca", _alpaca),
):  # fmt: skip
    CONVERTERS.add(_name, _conv)

# the TRL format each source format becomes (auto: whatever the first row's keys say)
BECOMES = {"messages": "messages", "prompt_completion": "prompt/completion", "text": "text",
           "preference": "preference", "sharegpt": "messages", "alpaca": "messages"}  # fmt: skip


def auto_format(row: Any) -> str:
    """The source format a first row looks like: sharegpt, alpaca, else auto (TRL keys)."""
    if isinstance(row, dict) and "conversations" in row:
        return "sharegpt"
    if isinstance(row, dict) and "instruction" in row and "output" in row:
        return "alpaca"
    return "auto"


def renamed(row: Any, columns: dict[str, str]) -> Row | str:
    """The row with each mapped source column under its format key."""
    if not isinstance(row, dict) or not columns:
        return row  # type: ignore[no-any-return]
    missing = [col for col in columns.values() if col not in row]
    if missing:
        return f"missing column {missing[0]!r} (mapped by columns:; keys: {', '.join(sorted(row))})"
    out = {k: v for k, v in row.items() if k not in columns.values()}
    return out | {key: row[col] for key, col in columns.items()}


def converted(row: Any, fmt: str, columns: dict[str, str]) -> Row | str:
    """Rename, then convert (`fmt`: a source format; auto converts nothing)."""
    row = renamed(row, columns)
    if isinstance(row, str) or fmt == "auto" or not isinstance(row, dict):
        return row
    return CONVERTERS.get(fmt)(row)
