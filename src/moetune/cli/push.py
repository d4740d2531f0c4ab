"""`moetune push`: a run's promoted adapter (or a checked export) to the Hugging Face Hub
with a generated model card. Registered on moetune's one typer app."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from moetune.cli.common import JsonOpt, app, console, emit_json, friendly


@app.command("push")
@friendly
def push_cmd(
    run_dir: Annotated[Path, typer.Argument(help="A run dir (output.dir of a run).")],
    repo: Annotated[str, typer.Option(help="The Hub repo to push to: user/name.")],
    export: Annotated[
        str | None,
        typer.Option(help="Push this export of the run (a format in RUN_DIR/exports.json)."),
    ] = None,
    private: Annotated[
        bool, typer.Option("--private/--public", help="Visibility of a repo it creates.")
    ] = True,
    unpromoted: Annotated[
        bool,
        typer.Option(help="Push an adapter the gate did not promote (or an unchecked export)."),
    ] = False,
    base_model: Annotated[
        str | None, typer.Option(help="The base's Hub id for the card (model.id is a dir).")
    ] = None,
    license_id: Annotated[
        str | None, typer.Option("--license", help="License id for the card (default: the base's).")
    ] = None,
    results: Annotated[
        Path | None, typer.Option(help="Eval results dir (default RUN_DIR/eval).")
    ] = None,
    ledger: Annotated[Path | None, typer.Option(help="Ledger file (default: the run's).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Upload the adapter (or an export) with a model card; refuses an unpromoted adapter."""
    # lazy: the stage loads only when its command runs
    from moetune.report.push import PushOptions, push

    opts = PushOptions(repo, export, private, unpromoted, base_model, license_id, results, ledger)
    doc = push(run_dir, opts)
    if as_json:
        emit_json(doc)
    else:
        _print(doc)


def _print(doc: dict[str, Any]) -> None:
    visibility = "private" if doc["private"] else "public"
    console.print(
        f"pushed {doc['what']} ({len(doc['files'])} files, {doc['bytes']:,} bytes) → "
        f"{escape(doc['url'])} ({visibility} if created) · commit {doc['commit'][:12]}"
    )
    if not doc["vouched"]:
        console.print(f"[yellow]unpromoted:[/] {escape(doc['refusal'])} (the card says so)")
