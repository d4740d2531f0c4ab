"""The moetune command line: one typer app; each command calls one entry function."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import typer
from rich.console import Console

from moetune import __version__
from moetune.errors import MoetuneError

app = typer.Typer(
    name="moetune",
    help="Fine-tune Mixture-of-Experts LLMs on limited GPU memory, first time right.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])


def friendly(fn: F) -> F:
    """Print a MoetuneError as one line (cause + fix) and exit non-zero, no traceback."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MoetuneError as err:
            msg = f"[bold red]error:[/] {err.cause}"
            if err.fix:
                msg += f" [bold]fix:[/] {err.fix}"
            err_console.print(msg, highlight=False, soft_wrap=True)
            raise typer.Exit(err.exit_code) from None

    return wrapper  # type: ignore[return-value]


def emit_json(payload: Any) -> None:
    """Machine-readable output: one JSON document on stdout."""
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")


@app.command()
def version() -> None:
    """Print moetune's version."""
    console.print(__version__)


def main() -> None:  # pragma: no cover - console entry
    app()
