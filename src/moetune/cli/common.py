"""What every command shares: the typer app and its root options, the consoles, the
common options (--json, --set), `friendly` and `emit_json`, and the CLI's one guard.

The guard: whatever a command raises reaches the user as one line.

A MoetuneError prints its cause and fix (exit 2, as every user error); a library exception
whose cause is known to be the user's input (a malformed hub id, a path too long, a NUL
byte, no permission) is put in the same words; anything else prints one line naming the
exception type and the hint to rerun with --debug (exit 3). --debug or MOETUNE_DEBUG=1
lets the traceback through.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from functools import wraps
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from moetune import __version__
from moetune.errors import ConfigError, ModelSourceError, MoetuneError, clip, os_problem
from moetune.io import mask_text, masked
from moetune.ledger import Terminated

UNEXPECTED = 3  # exit status of an error moetune did not foresee (2: a user's input)
INTERRUPTED, TERMINATED = 130, 143  # 128 + the signal number, as shells report them


class StdoutLost(OSError):
    """stdout refused a write (its reader left, its disk is full): told apart from any
    other file's error of the same errno."""


@contextlib.contextmanager
def _told_apart(name: str) -> Iterator[None]:
    try:
        yield
    except OSError as err:
        if name != "stdout" or isinstance(err, StdoutLost):
            raise
        raise StdoutLost(err.errno, err.strerror) from err


def write_stdout(text: str) -> None:
    """`text` on stdout; a refused write raises StdoutLost."""
    with _told_apart("stdout"):
        sys.stdout.write(text)
        sys.stdout.flush()


class MaskedStream:
    """sys.stdout or sys.stderr – whichever is current at each write, as rich resolves them
    – with every secret masked on its way out (moetune.io's one masker)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, text: str) -> int:
        with _told_apart(self.name):
            getattr(sys, self.name).write(mask_text(text))
        return len(text)

    def flush(self) -> None:
        with _told_apart(self.name):
            getattr(sys, self.name).flush()

    def __getattr__(self, attr: str) -> Any:  # flush, isatty, fileno, encoding …
        return getattr(getattr(sys, self.name), attr)


err_console = Console(file=MaskedStream("stderr"))  # type: ignore[arg-type]


class UsageError(MoetuneError):
    """A command line typer refused (an unknown option, a missing argument), as --json says it."""


# Whether the command being run was given --json: set by the guard as it resolves the
# command, read wherever an error is printed (a ContextVar: typer vendors its own click).
JSON_WANTED: ContextVar[bool] = ContextVar("moetune_json", default=False)


def wants_json(args: list[str]) -> bool:
    """Whether a command line asks for --json (options end at a bare "--")."""
    head = args[: args.index("--")] if "--" in args else args
    return "--json" in head


def emit_error(kind: str, cause: str, fix: str, exit_code: int) -> None:
    """With --json, an error is one JSON object on stdout too (the line still goes to
    stderr), so a script reading stdout always gets JSON, whatever went wrong."""
    error = {"type": kind, "cause": cause, "fix": fix, "exit_code": exit_code}
    emit_json({"error": error})


def print_error(err: MoetuneError, as_json: bool | None = None) -> None:
    """A MoetuneError as the one line a user sees: cause, then fix (secrets masked); with
    --json also one JSON object on stdout."""
    if JSON_WANTED.get() if as_json is None else as_json:
        emit_error(type(err).__name__, err.cause, err.fix, err.exit_code)
    msg = f"[bold red]error:[/] {escape(mask_text(err.cause))}"
    if err.fix:
        msg += f" [bold]fix:[/] {escape(mask_text(err.fix))}"
    err_console.print(msg, highlight=False, soft_wrap=True)


def known_error(err: Exception) -> MoetuneError | None:
    """Library exceptions whose cause is a user's input, in words (the rest are bugs)."""
    # lazy: heavy to import (huggingface_hub)
    from huggingface_hub.errors import HFValidationError

    if isinstance(err, HFValidationError):
        return ModelSourceError(
            f"not a valid hub model id: {clip(err, 120)}",
            "write a hub id as owner/name (at most 96 characters), or pass a local dir",
        )
    if isinstance(err, OSError) and err.errno == errno.ENAMETOOLONG:
        return ConfigError(
            f"{clip(err.filename, 60)}: {os_problem(err)}",
            "shorten the path (at most 255 bytes per name, 4096 in all on most systems)",
        )
    if isinstance(err, PermissionError):
        return ConfigError(
            f"{clip(err.filename, 80)}: permission denied",
            "use a path you may write to (e.g. --set output.dir=...), or fix its permissions",
        )
    if isinstance(err, ValueError) and "null byte" in str(err):  # os calls refuse "\0"
        return ConfigError(f"a path or id contains a NUL byte ({clip(err, 60)})", "remove it")
    return None


def report_error(err: Exception) -> int:
    """Print `err` as the one line a user sees; returns the exit status."""
    known = err if isinstance(err, MoetuneError) else known_error(err)
    if known is not None:
        print_error(known)
        return known.exit_code
    if JSON_WANTED.get():
        hint = "rerun as `moetune --debug …` for the traceback"
        emit_error("unexpected", f"unexpected {type(err).__name__}: {clip(err)}", hint, UNEXPECTED)
    err_console.print(
        f"[bold red]error:[/] unexpected {type(err).__name__}: {escape(clip(err))} "
        "[bold]hint:[/] rerun as `moetune --debug …` (or with MOETUNE_DEBUG=1) for the traceback",
        highlight=False,
        soft_wrap=True,
    )
    return UNEXPECTED


# stdout that takes no more: its reader left (`moetune … | head`) or its disk is full
STDOUT_LOST = {errno.EPIPE: 1, errno.ENOSPC: 2, errno.EDQUOT: 2}


def stdout_lost(err: Exception) -> int | None:
    """The exit status when `err` is stdout refusing a write (None otherwise). Its reader
    gone: quiet, no traceback; a full disk: one line on stderr, as the output is lost.
    stdout then points at /dev/null, so the interpreter's own flush at exit finds a sink."""
    if not isinstance(err, StdoutLost) or err.errno not in STDOUT_LOST:
        return None
    with contextlib.suppress(OSError, ValueError):  # no fd under a test runner's capture
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if err.errno != errno.EPIPE:
        err_console.print(
            f"[bold red]error:[/] stdout could not be written ({os_problem(err)}); the output "
            "is incomplete [bold]fix:[/] send stdout to a disk with free space",
            highlight=False,
            soft_wrap=True,
        )
    return STDOUT_LOST[err.errno]


# What to run after Ctrl-C / SIGTERM, by command: only `train` has a --resume (quickstart and
# eval start afresh; eval publishes its results only whole, so a stopped one left none).
RERUN = {
    "train": "rerun it with --resume (`moetune train … --resume` continues the run from its "
    "last checkpoint)",
    "quickstart": "rerun `moetune quickstart` (it starts afresh in a new folder)",
    "eval": "rerun the same `moetune eval …` (a stopped eval publishes no results; earlier "
    "ones are as they were)",
}


def report_interrupt(err: KeyboardInterrupt, command: str | None = None) -> int:
    """Ctrl-C or SIGTERM: one line saying what was kept (click would print a bare "Aborted!")
    and how to go on with `command` (the subcommand that was stopped)."""
    what = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted (Ctrl-C)"
    notes = getattr(err, "__notes__", None)  # a command's own word on what it left (export)
    fix = escape(notes[-1] if notes else RERUN.get(command or "", "rerun the same command"))
    err_console.print(
        f"[bold yellow]{what}:[/] stopped; finished files and checkpoints are kept and a run "
        f"records the attempt as cancelled in its ledger [bold]fix:[/] {fix}",
        highlight=False,
        soft_wrap=True,
    )
    return TERMINATED if isinstance(err, Terminated) else INTERRUPTED


PATHLESS = {"version"}  # commands that resolve no path, so need no working directory


def check_working_dir() -> None:
    """A working directory deleted under the shell (`cd d && rmdir ../d`): every relative
    path would read as "not found" and a relative output dir could not be made, so say so."""
    try:
        os.getcwd()
    except FileNotFoundError:
        raise ConfigError(
            "the working directory no longer exists (deleted or moved after the shell entered it)",
            "cd to an existing directory (e.g. cd ~) and run the command again",
        ) from None


class GuardedGroup(TyperGroup):
    """The one guard between a command and the user: a MoetuneError prints as one line
    (exit 2), any other exception as one line naming its type (exit 3) – its traceback
    only with --debug or MOETUNE_DEBUG=1."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name, cmd, rest = super().resolve_command(ctx, args)
        JSON_WANTED.set(JSON_WANTED.get() or wants_json(rest))
        if name not in PATHLESS:
            check_working_dir()
        return name, cmd, rest

    def invoke(self, ctx: Any) -> Any:
        token = JSON_WANTED.set(False)
        try:
            return self._guarded(ctx)
        finally:
            JSON_WANTED.reset(token)

    def _guarded(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise  # a command's own exit status
        except typer.TyperException as err:  # a usage error: typer prints it itself …
            if not (JSON_WANTED.get() and hasattr(err, "format_message")):
                raise
            code = getattr(err, "exit_code", 2)  # … but --json wants it as JSON too
            print_error(UsageError(err.format_message(), "see the command's --help"))
            raise typer.Exit(code) from None
        except KeyboardInterrupt as err:
            raise typer.Exit(report_interrupt(err, ctx.invoked_subcommand)) from None
        except Exception as err:
            if (code := stdout_lost(err)) is not None:
                raise typer.Exit(code) from None
            debug = ctx.params.get("debug") or os.environ.get("MOETUNE_DEBUG") == "1"
            if debug and not isinstance(err, MoetuneError):
                raise
            raise typer.Exit(report_error(err)) from None


# Before torch loads libgomp: OpenMP threads spinning at barriers slow small CPU training
# 10x or more whenever another process shares the cores (measured: quickstart 70 s vs
# > 6 min). Passive waiting costs little; users can still set their own policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Transparent huge pages for torch's large CPU tensors (read once, at the first one): an
# offloaded step allocates every layer's widened stacks afresh, and 4 KiB page faults cost
# the disk stream 0.53 vs 1.09 GB/s of a 1.7 GB/s disk (benchmarks/offload_stream.py).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

console = Console(file=MaskedStream("stdout"))  # type: ignore[arg-type]
app = typer.Typer(
    name="moetune",
    help="Fine-tune Mixture-of-Experts LLMs on limited GPU memory, first time right.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    cls=GuardedGroup,
)
F = TypeVar("F", bound=Callable[..., Any])


@app.callback()
def root(
    debug: Annotated[
        bool,
        typer.Option("--debug", envvar="MOETUNE_DEBUG", help="Show unexpected errors' tracebacks."),
    ] = False,
) -> None:
    """Fine-tune Mixture-of-Experts LLMs on limited GPU memory, first time right."""


def friendly(fn: F) -> F:
    """Print a MoetuneError as one line (cause + fix) and exit non-zero, no traceback."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MoetuneError as err:
            print_error(err)
            raise typer.Exit(err.exit_code) from None

    return wrapper  # type: ignore[return-value]


def emit_json(payload: Any) -> None:
    """Machine-readable output: one JSON document on stdout, secrets masked in every string
    before encoding (a secret JSON escapes is found all the same)."""
    write_stdout(mask_text(json.dumps(masked(payload), indent=2, default=str)) + "\n")


@app.command()
def version() -> None:
    """Print moetune's version."""
    console.print(__version__)


def main() -> None:  # pragma: no cover - console entry
    app()


JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a config field: section.field=value (a list: a,b)."),
]
