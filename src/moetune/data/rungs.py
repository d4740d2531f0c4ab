"""The eval ladder's rung files, checked before the spend: each rung kind's row convention,
and `ladder_problem`, the one check that lint (rule EVAL-LADDER), `moetune data` and the
train preflight run on eval.rungs – a mistyped kind, a missing or malformed rung file, a
metric no kind reads – so a ladder `moetune eval` would refuse is
refused before any training, in the same line. `moetune eval` reads its items through it.

A rung kind's scoring lives in evaluate/rungs.py (above this floor); its rows are declared
here, in RUNG_ROWS, so the floors below evaluate can check them.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetune.config import EvalArgs, RungArgs
from moetune.data.errors import DataError
from moetune.data.files import read_rows
from moetune.registry import Registry

Item = dict[str, Any]
Check = Callable[[Item], str | None]  # what is wrong with a row, or None
DEFAULT_METRIC = "acc"  # RungArgs.metric's default: what a rung that reads no metric carries


@dataclass(frozen=True)
class Problem:
    """A ladder mistake in one line and its fix; each caller raises or reports it as its own."""

    cause: str
    fix: str


@dataclass(frozen=True)
class RungRows:
    """A rung kind's rows: an example for messages, and their check (None: the kind reads no
    data file – lm_eval's task names its own data)."""

    example: str
    check: Check | None
    metric: bool = False  # whether the kind reads eval.rungs[].metric


RUNG_ROWS: Registry[RungRows] = Registry("rung kind", DataError)


def need_strings(item: Item, *keys: str) -> str | None:
    for key in keys:
        if not isinstance(item.get(key), str) or not item[key]:
            return f"needs a non-empty string {key!r}"
    return None


def answer_index(item: Item) -> int | None:
    """A multiple_choice row's answer as an index into its choices (None: not one of them)."""
    answer, choices = item.get("answer"), item.get("choices")
    if isinstance(answer, int) and not isinstance(answer, bool):
        return answer if 0 <= answer < len(choices or []) else None
    return choices.index(answer) if isinstance(choices, list) and answer in choices else None


def _loss_row(item: Item) -> str | None:
    return (
        need_strings(item, "text") if "text" in item else need_strings(item, "prompt", "completion")
    )


def _answer_row(item: Item) -> str | None:
    return need_strings(item, "prompt", "answer")


def _choice_row(item: Item) -> str | None:
    choices = item.get("choices")
    if not isinstance(choices, list) or len(choices) < 2:
        return "needs 'choices': a list of at least two strings"
    if not all(isinstance(c, str) and c for c in choices):
        return "has a choice that is not a non-empty string"
    if answer_index(item) is None:
        return "needs 'answer': an index into choices or one of the choices"
    return need_strings(item, "prompt")


ANSWER_ROW = '{"prompt": "...", "answer": "..."}'
RUNG_ROWS.add(
    "loss", RungRows('{"text": "..."} or {"prompt": "...", "completion": "..."}', _loss_row)
)
RUNG_ROWS.add("exact_match", RungRows(ANSWER_ROW, _answer_row))
RUNG_ROWS.add("contains", RungRows(ANSWER_ROW, _answer_row))
RUNG_ROWS.add(
    "multiple_choice",
    RungRows('{"prompt": "...", "choices": ["a", "b"], "answer": 0}', _choice_row),
)
RUNG_ROWS.add("lm_eval", RungRows("task: <name>, include_path: <folder>", None, metric=True))


def data_field(args: RungArgs) -> str:
    """The option that gives a rung its file: named in every error about it."""
    return f"eval.rungs[].data of rung {args.name!r}"


def kind_problem(args: RungArgs) -> Problem | None:
    if args.kind in RUNG_ROWS:
        return None
    near = difflib.get_close_matches(args.kind, RUNG_ROWS.names(), 1)
    guess = f"did you mean {near[0]!r}? " if near else ""
    return Problem(
        f"rung {args.name!r}: unknown kind {args.kind!r}",
        f"{guess}use one of: {', '.join(RUNG_ROWS.names())}",
    )


def rung_items(args: RungArgs, limit: int | None, field: str | None = None) -> list[Item]:
    """The first `limit` rows of a rung's data file, every one checked; the first problem
    raises (DataError) with the file and line."""
    kind = RUNG_ROWS.get(args.kind)
    field = field or data_field(args)
    if not args.data:
        raise DataError(
            f"rung {args.name!r} ({args.kind}) has no data file",
            f"set eval.rungs[].data for {args.name!r} to a JSONL file",
        )
    try:
        rows = read_rows(Path(args.data))  # relative to the working dir, like data.train_file
    except DataError as err:
        raise DataError(
            f"{field}: {err.cause}", f"point {field} at a JSONL file of {kind.example} rows"
        ) from None
    items = [row for _, row in rows][:limit]
    for (where, _), item in zip(rows, items, strict=False):
        bad = kind.check(item) if isinstance(item, dict) and kind.check else None
        bad = bad if isinstance(item, dict) else "is not a JSON object"
        if bad:
            raise DataError(
                f"rung {args.name!r}: {args.data} {where}: row {bad}",
                f"{args.kind} rows look like {kind.example}",
            )
    return items


def rung_problem(args: RungArgs, limit: int | None) -> Problem | None:
    """What `moetune eval` would refuse in this rung before scoring, or None."""
    if problem := kind_problem(args):
        return problem
    kind = RUNG_ROWS.get(args.kind)
    if args.metric != DEFAULT_METRIC and not kind.metric:
        return Problem(
            f"rung {args.name!r}: metric {args.metric!r} is not read by {args.kind} rungs "
            "(their score is fixed by the kind)",
            "drop eval.rungs[].metric (only lm_eval rungs pick a metric), or change the kind",
        )
    if kind.check is None:
        if not args.task:
            return Problem(
                f"rung {args.name!r} ({args.kind}) names no task",
                "set eval.rungs[].task (and include_path for a local task YAML)",
            )
        return None
    try:
        rung_items(args, limit)
    except DataError as err:
        return Problem(err.cause, err.fix)
    return None


def ladder_problem(ladder: EvalArgs) -> Problem | None:
    """The first mistake in eval.rungs that `moetune eval` would stop at, or None: what lint,
    `moetune data` and the train preflight all check, before anything is spent."""
    for args in ladder.rungs:
        if problem := rung_problem(args, ladder.limit):
            return problem
    return None


def check_ladder(ladder: EvalArgs) -> None:
    """ladder_problem as a DataError: `moetune data` and `moetune train` stop at it."""
    if problem := ladder_problem(ladder):
        raise DataError(problem.cause, problem.fix)
