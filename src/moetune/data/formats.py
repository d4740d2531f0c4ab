"""Row formats: TRL's conventions (`FORMATS`, a registry in detection order), the checks a
row must pass, and the other common layouts converted into them (`CONVERTERS`).

    messages            {"messages": [{"role": "user", "content": ...}, ...]}
    prompt/completion   {"prompt": ..., "completion": ...}   (strings or message lists)
    text                {"text": ...}
    preference          {"prompt": ..., "chosen": ..., "rejected": ...}   (DPO)
    prompt              {"prompt": ..., other columns}                    (GRPO)
    sharegpt            {"conversations": [{"from": "human", "value": ...}, ...]} -> messages
    alpaca              {"instruction": ..., "input": ..., "output": ...}          -> messages

A source's `columns` renames its keys onto these first. Completion-only loss where the
format allows it: prompt/completion rows train on the completion, messages rows on the
assistant turns (through the template's `{% generation %}` markers, else through masks from
rendered prefixes, template.py), text rows on every token. The choice is recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moetune.data.errors import DataError
from moetune.data.images import block_problem, block_text, text_turns
from moetune.data.template import applied, has_markers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Row = dict[str, Any]
ROLES = ("system", "user", "assistant", "tool")
TURN_KEYS = ("role", "content", "tool_calls", "name", "tool_call_id")  # what a turn keeps


# ---------------------------------------------------------------- formats


def _turn_problem(n: int, turn: Any) -> str | None:
    """What is wrong with one chat turn (1-based `n`), or None."""
    if not isinstance(turn, dict):
        return f"turn {n} is not a {{role, content}} object"
    role, content = turn.get("role"), turn.get("content")
    if role not in ROLES:
        return f"turn {n} has role {role!r}; roles are {', '.join(ROLES)}"
    if content is None and turn.get("tool_calls"):
        return None  # an assistant turn that only calls tools
    if isinstance(content, list):  # content blocks: text and images (images.py)
        problem = block_problem(content)
        if problem:
            return f"turn {n} ({role}): {problem}"
    elif not isinstance(content, str):
        return f"turn {n} ({role}) has no text content"
    if role == "assistant" and not block_text(content).strip():
        return f"turn {n} is an empty assistant turn (nothing to learn, or a lost reply)"
    return None


def _turns_problem(key: str, value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return f"'{key}' must be a non-empty list of {{role, content}} objects"
    problem = next(filter(None, (_turn_problem(n, t) for n, t in enumerate(value, 1))), None)
    return f"'{key}' {problem}" if problem else None


def _is_messages(value: Any) -> bool:
    return _turns_problem("", value) is None


def _check_messages(row: Row) -> str | None:
    turns = row["messages"]
    problem = _turns_problem("messages", turns)
    if problem:
        return problem
    if not any(m["role"] == "assistant" for m in turns):
        return "'messages' has no assistant turn, so there is nothing to learn"
    return None


def _check_prompt_completion(row: Row) -> str | None:
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return None if completion.strip() else "'completion' is empty"
    if isinstance(prompt, list) and isinstance(completion, list):
        return _turns_problem("prompt", prompt) or _turns_problem("completion", completion)
    return "'prompt' and 'completion' must both be strings or both be message lists"


def _check_text(row: Row) -> str | None:
    text = row["text"]
    return None if isinstance(text, str) and text.strip() else "'text' must be a non-empty string"


def _check_preference(row: Row) -> str | None:
    prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        empty = next((k for k in ("chosen", "rejected") if not row[k].strip()), None)
        if empty:
            return f"'{empty}' is empty (DPO compares two real answers)"
        return "'chosen' and 'rejected' are the same" if chosen == rejected else None
    if all(isinstance(v, list) for v in (prompt, chosen, rejected)):
        keys = ("prompt", "chosen", "rejected")
        return next(filter(None, (_turns_problem(k, row[k]) for k in keys)), None)
    return "'prompt', 'chosen' and 'rejected' must all be strings or all be message lists"


def _check_prompt(row: Row) -> str | None:
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return None if prompt else "'prompt' is empty"
    return None if _is_messages(prompt) else "'prompt' must be a string or a message list"


@dataclass(frozen=True)
class Loss:
    """Where the loss goes, as SFTConfig fields and in words."""

    sft: dict[str, Any]
    on: str
    prerender: bool = False  # rows go to TRL tokenised, with moetune's assistant masks


def _messages_loss(completion_only: bool, tok: PreTrainedTokenizerBase) -> Loss:
    if not completion_only:
        return Loss({"assistant_only_loss": False}, "all tokens (data.completion_only_loss off)")
    if has_markers(tok):
        return Loss({"assistant_only_loss": True}, "assistant turns")
    # TRL masks assistant turns only through generation markers: moetune's masks instead
    on = "assistant turns (masked by rendering prefixes: the template has no generation markers)"
    return Loss({"assistant_only_loss": False}, on, prerender=True)


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
    out: Any = applied(tok, text_turns(turns), tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # a BatchEncoding in v5


def _text_ids(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids: list[int] = tok(text, add_special_tokens=False)["input_ids"]
    return [*ids, tok.eos_token_id] if tok.eos_token_id is not None else ids


def _pc_length(row: Row, tok: PreTrainedTokenizerBase) -> int:
    if isinstance(row["prompt"], str):
        return len(_text_ids(tok, row["prompt"] + row["completion"]))
    return len(_chat_ids(tok, row["prompt"] + row["completion"]))


def prompt_fills(row: Row, fmt: DataFormat, tok: PreTrainedTokenizerBase, seq_len: int) -> bool:
    """Whether the row's prompt alone fills seq_len: truncated there, no completion token is
    left to learn from (TRL then drops the row). False where the format has no prompt."""
    return bool(fmt.prompt_keys) and _ids(row, tok, *fmt.prompt_keys) > seq_len  # its eos: >


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
    sampled: bool = False  # the loss is on completions sampled in training: rows carry none
    # the keys tokenised together, per sequence (preference rows hold two); () is all keys
    sequences: tuple[tuple[str, ...], ...] = ()
    # the keys before the first trained token (a completion-only loss masks them)
    prompt_keys: tuple[str, ...] = ()

    def token_sequences(self) -> tuple[tuple[str, ...], ...]:
        return self.sequences or (self.keys,)


FORMATS: dict[str, DataFormat] = {
    f.name: f
    for f in (
        DataFormat("messages", ("messages",), _check_messages, _messages_loss,
                   lambda r, t: len(_chat_ids(t, r["messages"]))),
        DataFormat("prompt/completion", ("prompt", "completion"), _check_prompt_completion,
                   _prompt_completion_loss, _pc_length, prompt_keys=("prompt",)),
        DataFormat("text", ("text",), _check_text, _text_loss,
                   lambda r, t: len(_text_ids(t, r["text"]))),
        DataFormat("preference", ("prompt", "chosen", "rejected"), _check_preference,
                   _preference_loss, _preference_length,
                   sequences=(("prompt", "chosen"), ("prompt", "rejected"))),
        # last: any row with a prompt matches it; GRPO keeps the other columns for rewards
        DataFormat("prompt", ("prompt",), _check_prompt, _prompt_loss,
                   lambda r, t: _ids(r, t, "prompt"), extras=True, sampled=True),
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
    path: Any, where: str, row: Any, allowed: tuple[str, ...] = SFT_FORMATS
) -> DataFormat:
    """The format of a source from its first row; DataError naming the keys when none fits
    (`path`: the source as the error names it)."""
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


def check_row(path: Any, where: str, row: Any, fmt: DataFormat, columns: Any = None) -> Row:
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
    keys = sorted(row) if fmt.extras else (*fmt.keys, *(["images"] if row.get("images") else []))
    return {k: _plain(row[k]) if k in fmt.keys else row[k] for k in keys}


def _column_problem(row: Row, fmt: DataFormat, columns: Any) -> str | None:
    """Rows that keep extra columns must all have the first row's (`datasets` needs one
    schema)."""
    if not fmt.extras or columns is None or set(row) == set(columns):
        return None
    missing = sorted(set(columns) - set(row)) or sorted(set(row) - set(columns))
    return f"columns differ from the first row's ({', '.join(missing)})"


def _plain(value: Any) -> Any:
    """Turns keep role, content and the tool-call keys they set, nothing else."""
    if isinstance(value, list):
        return [{k: m[k] for k in TURN_KEYS if m.get(k) is not None or k == "content"}
                for m in value]  # fmt: skip
    return value
