"""A results dir as `moetune eval` writes it, read back and checked before the gate trusts it.

    <results>/ladder.json               the ladder: per rung its settings, n and items file
    <results>/rungs/<name>.json         one rung's summary
    <results>/rungs/<name>.items.jsonl  per item: "i", base and candidate score and output
    <results>/verdict.json              the gate's verdict (with its own hash)

The per-item files are the source of truth: the gate recomputes every statistic from them,
so it first checks that each holds exactly the ladder's item ids 0..n-1, once each, with a
finite base and candidate score – a duplicated, shifted or truncated file would otherwise
give bounds on the wrong n. Only the files named here are moetune's: `--overwrite` removes
those and nothing else a user keeps in the folder.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from itertools import islice
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, TypeAdapter, ValidationError

from moetune.config import GateArgs, RungArgs
from moetune.errors import clip, os_problem
from moetune.evaluate.errors import EvalError, GateError
from moetune.io import adapter_digest as adapter_digest  # re-exported: eval, gate, tests
from moetune.io import fsync_path, write_problem

LADDER, VERDICT, RUNGS = "ladder.json", "verdict.json", "rungs"
REDO = "re-run `moetune eval --overwrite` (per-item files are never edited by hand)"


class RungDoc(BaseModel):
    """What the gate reads of one ladder.json rung."""

    model_config = ConfigDict(extra="ignore")
    name: str
    unit: Literal["accuracy", "neg_nll"]
    n: int = Field(ge=1)
    items_file: str
    args: RungArgs


class LadderDoc(BaseModel):
    """What the gate reads of ladder.json."""

    model_config = ConfigDict(extra="ignore")
    rungs: list[RungDoc] = Field(min_length=1)
    gate: GateArgs
    adapter: str
    adapter_sha256: str
    ledger: str
    adapter_from_results: str | None = None  # the adapter's path relative to this dir
    results: str | None = None  # where eval wrote this dir (as the config named it)


class ItemRow(BaseModel):
    """One line of a per-item file (outputs are free-form and not read)."""

    model_config = ConfigDict(extra="ignore")
    i: int
    base: FiniteFloat
    candidate: FiniteFloat


_ROWS: TypeAdapter[list[ItemRow]] = TypeAdapter(list[ItemRow])


def _first_line(err: Exception) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # ValueError: bad JSON and non-UTF-8 bytes alike
        why = os_problem(err) if isinstance(err, OSError) else _first_line(err)
        raise GateError(
            f"cannot read {clip(path, 100)}: {why}",
            "point at a results dir written by `moetune eval` (it holds ladder.json)",
        ) from None


def _where(err: ValidationError) -> str:
    first = err.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc']) or 'the document'}: {first['msg']}"


def read_ladder(results: Path) -> tuple[dict[str, Any], LadderDoc]:
    """ladder.json as written (for the ledger and report) and its checked fields."""
    raw = read_json(results / LADDER)
    try:
        doc = LadderDoc.model_validate(raw)
    except ValidationError as err:
        cause = f"{results / LADDER} is not a moetune ladder ({_where(err)})"
        raise GateError(cause, REDO) from None
    for rung in doc.rungs:
        inside = PurePosixPath(rung.items_file)
        if inside.is_absolute() or ".." in inside.parts:
            cause = f"{results / LADDER}: rung {rung.name!r} points outside {results}"
            raise GateError(cause, REDO)
    return raw, doc


def evaluated_adapter(results: Path, doc: LadderDoc) -> Path:
    """The adapter a gate on `results` may mark: found where it sat relative to the results
    dir, so a copied or moved run dir marks its own copy – never the original's, outside
    the run dir it was given; an adapter kept outside the run dir only where it was evaluated."""
    here, recorded = results.resolve(), Path(doc.adapter)
    if doc.adapter_from_results:
        found = Path(os.path.normpath(here / doc.adapter_from_results))
        if found.is_relative_to(here.parent) or found == recorded:
            return found
    elif recorded.is_relative_to(here.parent) or _same_place(doc.results, here):
        return recorded  # written before eval recorded the relative path
    raise GateError(
        f"{clip(results, 80)} was copied or moved away from the adapter it evaluated "
        f"({clip(recorded, 80)}), so promoting would mark an adapter outside it",
        "keep the adapter beside its results (RUN/adapter and RUN/eval), or re-run "
        "`moetune eval` on the adapter where it is now",
    )


def _same_place(written: str | None, here: Path) -> bool:
    return written is not None and Path(written).resolve() == here


def read_items(results: Path, rung: RungDoc) -> list[ItemRow]:
    """The rung's per-item rows in id order, each scored by base and candidate, ids checked."""
    path = results / rung.items_file
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        rows = _ROWS.validate_python([json.loads(line) for line in lines if line.strip()])
    except (OSError, ValueError) as err:  # ValidationError is a ValueError too
        why = _where(err) if isinstance(err, ValidationError) else _first_line(err)
        why = os_problem(err) if isinstance(err, OSError) else why
        raise GateError(f"cannot read {path}: {why}", REDO) from None
    problem = id_problem([r.i for r in rows], rung.n)
    if problem:
        raise GateError(f"rung {rung.name!r}: {path} {problem}", REDO)
    return sorted(rows, key=lambda r: r.i)  # in id order: the same sums whatever the file order


def worst_items(results: Path, rung: RungDoc, k: int) -> list[dict[str, Any]]:
    """`k` items of a rung's (already checked) per-item file, where the candidate lost most
    against the base first: what the gate output and the report show of a failing rung."""
    lines = (results / rung.items_file).read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    rows.sort(key=lambda r: (r["candidate"] - r["base"], r["i"]))
    keys = ("i", "prompt", "expected", "base_output", "candidate_output")
    return [{key: row.get(key) for key in keys} for row in rows[:k]]


def _few(ids: list[int], total: int | None = None) -> str:
    more = (total if total is not None else len(ids)) - 5
    return ", ".join(map(str, ids[:5])) + (f" and {more} more" if more > 0 else "")


def id_problem(ids: list[int], n: int) -> str | None:
    """What is wrong with a per-item file's ids against the ladder's 0..n-1, or None.
    Never builds range(n): an edited ladder.json may claim any n."""
    counts = Counter(ids)
    repeated = sorted(i for i, k in counts.items() if k > 1)
    if repeated:
        first = repeated[0]
        return f"scores item {first} {counts[first]} times (repeated ids: {_few(repeated)})"
    unknown = sorted(i for i in counts if not 0 <= i < n)
    if unknown:
        return f"has ids outside the ladder's 0..{n - 1}: {_few(unknown)}"
    if len(counts) < n:
        missing = list(islice((i for i in range(n) if i not in counts), 5))
        gone = _few(missing, n - len(counts))
        return f"holds {len(counts)} of the ladder's {n} items (missing ids: {gone})"
    return None


# ---------------------------------------------------------------- what --overwrite removes


def owned_files(results: Path) -> list[Path]:
    """The files moetune wrote in a results dir: ladder.json, verdict.json and the rung files
    the ladder (or, when it is unreadable, the rungs/ naming convention) accounts for."""
    names = {LADDER, VERDICT}
    try:
        _, doc = read_ladder(results)
        for rung in doc.rungs:
            names |= {rung.items_file, f"{RUNGS}/{rung.name}.json"}
    except GateError:  # a torn or foreign ladder: fall back to the names moetune gives
        rungs = results / RUNGS
        found = [*rungs.glob("*.items.jsonl")] if rungs.is_dir() else []
        names |= {f"{RUNGS}/{p.name}" for p in found}
        names |= {f"{RUNGS}/{p.name.removesuffix('.items.jsonl')}.json" for p in found}
    return sorted(p for p in (results / n for n in names) if p.is_file())


def refuse_unasked_replace(results: Path, overwrite: bool) -> None:
    """Earlier results are never replaced silently; a folder of other files is fine."""
    problem = write_problem(results, folder=True)  # before any model loads
    if problem:
        raise EvalError(
            f"results dir {clip(results, 100)} {problem}",
            "set eval.results_dir to a writable folder",
        )
    if owned_files(results) and not overwrite:
        raise EvalError(
            f"{results} already holds eval results; they are never silently replaced",
            "pass --overwrite, or set eval.results_dir to a new folder",
        )


def publish(staged: Path, results: Path) -> None:
    """Move a complete staged results dir into `results`: earlier moetune files out first
    (ladder.json and verdict.json before the rest), then the new ones with ladder.json last,
    so a dir with a ladder.json always holds one whole run. Other files are left alone."""
    for old in sorted(owned_files(results), key=lambda p: p.parent != results):
        old.unlink()
    new = sorted((p for p in staged.rglob("*") if p.is_file()), key=lambda p: p.name == LADDER)
    for src in new:
        dst = results / src.relative_to(staged)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
        fsync_path(dst.parent)
