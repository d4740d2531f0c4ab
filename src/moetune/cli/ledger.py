"""`moetune ledger show|verify`: the append-only ledger of every attempt.
Registered on moetune's one typer app (imported at the end of cli.py)."""

from __future__ import annotations

import calendar
import time
from pathlib import Path
from typing import Annotated, get_args

import typer
from rich.markup import escape
from rich.table import Table

from moetune.cli.common import JsonOpt, app, console, emit_json, err_console, friendly
from moetune.errors import ConfigError, clip
from moetune.ledger import KINDS, Ledger, LedgerError, Status, select

ledger_app = typer.Typer(help="The append-only ledger of every attempt.", no_args_is_help=True)
app.add_typer(ledger_app, name="ledger")
LedgerPath = Annotated[Path, typer.Option("--path", help="Ledger file.")]


@ledger_app.command("show")
@friendly
def ledger_show(
    path: LedgerPath = Path(".moetune/ledger.jsonl"),
    run: Annotated[str | None, typer.Option(help="Only this run id.")] = None,
    kind: Annotated[str | None, typer.Option(help=f"Only this kind: {' | '.join(KINDS)}.")] = None,
    status: Annotated[
        str | None,
        typer.Option(help="ok | failed | infra-failed | cancelled | no-go | inconclusive"),
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="Only rows from this UTC date on (YYYY-MM-DD).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Rows of the ledger, filtered; skipped (torn or invalid) lines are reported."""
    if status is not None and status not in get_args(Status):
        raise ConfigError(
            f"--status {clip(status, 40)!r} is not a ledger status",
            f"use one of: {', '.join(get_args(Status))}",
        )
    if kind is not None and kind not in KINDS:
        raise ConfigError(
            f"--kind {clip(kind, 40)!r} is not a kind of ledger row",
            f"use one of: {', '.join(KINDS)}",
        )
    got = Ledger(path).read()
    rows = select(got.rows, run_id=run, kind=kind, status=status, since=_utc_date(since))
    if as_json:
        emit_json({"rows": [r.model_dump() for r in rows], "problems": got.problems})
        return
    table = Table("time", "kind", "status", "run", "cost $", "reason", title=str(path))
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(r.time))
        cost = "-" if r.cost_usd is None else f"{r.cost_usd:.2f}"
        table.add_row(when, r.kind, r.status, r.run_id or "-", cost, escape(r.reason))
    console.print(table)
    for line, problem in got.problems:
        err_console.print(f"[yellow]line {line} skipped:[/] {problem}")


def _utc_date(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(calendar.timegm(time.strptime(text, "%Y-%m-%d")))
    except ValueError:
        raise ConfigError(f"--since {text!r} is not a date", "write it as YYYY-MM-DD") from None


VERIFY_FIX = (
    "reads skip the problem lines; restore them from a copy of the file (it is git-friendly) "
    "or move it aside to start a new ledger"
)


@ledger_app.command("verify")
@friendly
def ledger_verify(
    path: LedgerPath = Path(".moetune/ledger.jsonl"), as_json: JsonOpt = False
) -> None:
    """Check every line; exit 1 when any line is torn or invalid, 2 when there is no ledger."""
    if not path.exists():
        raise LedgerError(
            f"no ledger at {clip(path, 80)}: nothing to verify",
            "pass --path to a ledger file (a run's is its output.ledger)",
        )
    got = Ledger(path).read()
    fix = VERIFY_FIX if got.problems else None
    if as_json:
        emit_json({"rows": len(got.rows), "problems": got.problems, "fix": fix})
    else:
        console.print(f"{len(got.rows)} valid rows, {len(got.problems)} problem lines")
        for line, problem in got.problems:
            console.print(f"  line {line}: {problem}")
    if fix:
        err_console.print(f"fix: {fix}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1)
