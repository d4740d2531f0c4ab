"""The ledger: one append-only JSONL row for every attempt of anything that costs time or
money (train, eval, gate, promote, provision, spend, infra failure) – failed ones too.

Rows are appended under an exclusive file lock as one `write` of a whole line followed by
fsync, so concurrent writers never interleave and a crash can only tear the last line.
Reading tolerates that torn line (reported, skipped, never fatal) and validates every row.
No secret ever lands in a row: values are redacted before they are written.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from filelock import FileLock
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moetune.errors import MoetuneError, clip, os_problem
from moetune.io import (
    REDACTED,
    SECRET_KEY,
    SECRET_VALUE,
    env_secrets,
    is_registered,
    known_secrets,
    mask_text,
)

Status = Literal["ok", "failed", "infra-failed", "cancelled", "no-go", "inconclusive"]
# no-go / inconclusive: a gate row whose verdict is not GO (the gate ran, the adapter did not pass)
# Every kind of row moetune writes (train, eval, export … by their stages; the rest by a
# launch and its cost guard) – what `ledger show --kind` accepts.
KINDS = ("train", "eval", "gate", "promote", "export", "push", "launch", "provision", "bank",
         "teardown", "spend", "infra")  # fmt: skip
DEFAULT_PATH = Path(".moetune") / "ledger.jsonl"
# the patterns live with the one masker (moetune.io); the ledger applies them to every row


class LedgerError(MoetuneError):
    """The ledger file cannot be used (unreadable path, bad row asked to be written)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a scheduler's stop, a pod shutting down), raised as an interrupt."""


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block SIGTERM raises `Terminated`, so the block unwinds as on Ctrl-C
    (ledger row, locks, live displays); the previous handler is restored after. Signal
    handlers belong to the main thread: elsewhere the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class LedgerRow(BaseModel):
    """One attempt. `metrics` and `cost` are free-form numbers; `reason` says why it ended so."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    time: float = Field(default_factory=time.time, description="Unix seconds, UTC.")
    kind: str = Field(description=f"What the attempt was: {' | '.join(KINDS)}")
    status: Status
    run_id: str | None = None
    config_hash: str | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    metrics: dict[str, Any] = Field(default_factory=dict)
    cost_usd: float | None = None
    seconds: float | None = None
    reason: str = ""


def redact(value: Any, secrets: Iterable[str] = ()) -> Any:
    """`value` with secret-named keys, secret-shaped strings, the process's registered
    secrets and the given ones masked."""
    known = known_secrets(secrets)
    if isinstance(value, Mapping):
        return {k: _redact_item(str(k), v, known) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v, known) for v in value]
    if isinstance(value, str):
        return mask_text(value, known)
    return value


def _redact_item(key: str, value: Any, known: list[str]) -> Any:
    """A secret-named key masks its value – unless it is a number: "tokens" and
    "tokens_per_s" are counts, and no credential is a bare number."""
    if SECRET_KEY.search(key) and not isinstance(value, int | float):
        return REDACTED
    return redact(value, known)


def is_secret(name: str, value: str, public: Iterable[str] | None = None) -> bool:
    """Whether an environment variable holds a secret: by its name, its value's shape, a
    registered value – and, for `lane.env` (its public names given), by not being public.
    A public name never unmasks a secret name or shape (HF_TOKEN stays masked)."""
    if SECRET_KEY.search(name) or SECRET_VALUE.search(value) or is_registered(value):
        return True
    return public is not None and name not in set(public)


def public_env(env: Mapping[str, str], public: Iterable[str] | None = None) -> dict[str, str]:
    """Environment variables as they may be shown or stored: every secret value masked
    (with `public` given, every entry not named in it as well)."""
    names = None if public is None else set(public)
    return {k: REDACTED if is_secret(k, v, names) else v for k, v in env.items()}


@dataclass
class ReadResult:
    """Valid rows, plus (line number, problem) for each line that was skipped."""

    rows: list[LedgerRow] = field(default_factory=list)
    problems: list[tuple[int, str]] = field(default_factory=list)


class Ledger:
    """An append-only JSONL ledger at `path` (default .moetune/ledger.jsonl)."""

    def __init__(self, path: Path | str = DEFAULT_PATH, secrets: Iterable[str] = ()) -> None:
        self.path = Path(path)
        self.secrets = list(secrets)  # besides the environment's: e.g. a launch's lane.env
        self._lock = FileLock(str(self.path) + ".lock")

    def append(self, row: LedgerRow) -> LedgerRow:
        """Write `row` (redacted) as one whole line, under the lock, and fsync it."""
        secrets = [*env_secrets(), *self.secrets]
        clean = LedgerRow.model_validate(redact(row.model_dump(), secrets))
        line = (json.dumps(clean.model_dump(), sort_keys=True) + "\n").encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._lock:
                self._heal_torn_tail()
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line)
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as err:
            raise self.unusable(err) from None
        return clean

    def _heal_torn_tail(self) -> None:
        """A crash mid-write leaves a last line without newline; end it so the next row
        starts on its own line (the torn text stays, and reads report it)."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with self.path.open("rb+") as fh:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")

    def read(self) -> ReadResult:
        """Every valid row in order; torn or invalid lines are reported, never fatal."""
        out = ReadResult()
        if not self.path.exists():
            return out
        try:
            data = self.path.read_bytes()
        except OSError as err:
            raise self.unusable(err) from None
        for number, raw in enumerate(data.splitlines(), start=1):
            if raw.strip():
                _parse_line(number, raw, out)
        return out

    def unusable(self, err: OSError) -> LedgerError:
        return LedgerError(
            f"ledger {clip(self.path, 80)}: {os_problem(err)}",
            "point --path / output.ledger at a ledger file (JSONL) that you may write",
        )


def _parse_line(number: int, raw: bytes, out: ReadResult) -> None:
    try:  # decoded as UTF-8 first: json.loads would guess UTF-16 from stray BOM-like bytes
        out.rows.append(LedgerRow.model_validate(json.loads(raw.decode("utf-8"))))
    except UnicodeDecodeError as err:  # before JSONDecodeError: both are ValueErrors
        out.problems.append((number, f"not UTF-8 text (byte {err.start}); a foreign write?"))
    except json.JSONDecodeError:
        out.problems.append((number, "torn or not JSON (a write interrupted by a crash?)"))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        out.problems.append((number, f"invalid row: {where}: {first['msg']}"))


def select(
    rows: Iterable[LedgerRow],
    run_id: str | None = None,
    kind: str | None = None,
    status: str | None = None,
    since: float | None = None,
) -> list[LedgerRow]:
    """Rows matching every filter given (None = any)."""
    wanted = {"run_id": run_id, "kind": kind, "status": status}
    return [
        r
        for r in rows
        if all(v is None or getattr(r, k) == v for k, v in wanted.items())
        and (since is None or r.time >= since)
    ]


@contextmanager
def attempt(path: Path | str, kind: str, **fields: Any) -> Iterator[dict[str, Any]]:
    """Ledger one row for the block: ok when it completes, cancelled on Ctrl-C or SIGTERM,
    failed on an error (its cause as the reason). The block fills the yielded dict (metrics,
    run_id, …). A ledger path that is a folder is refused before the block runs; a failed or
    cancelled row that cannot be written warns and never hides the block's own error."""
    row: dict[str, Any] = {"metrics": {}, **fields}
    started = time.perf_counter()
    if Path(path).is_dir():  # refused before the work, not after it (the ok row would fail)
        raise Ledger(path).unusable(IsADirectoryError(errno.EISDIR, "", str(path)))

    def write(status: Status, reason: str = "") -> None:
        seconds = round(time.perf_counter() - started, 3)
        fields = {**row, **({"reason": reason} if reason else {})}
        Ledger(path).append(LedgerRow(kind=kind, status=status, seconds=seconds, **fields))

    try:
        with sigterm_interrupts():  # restored before any row is written
            yield row
    except KeyboardInterrupt as err:
        how = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"
        _write_quietly(write, "cancelled", how)
        raise
    except Exception as err:
        cause = getattr(err, "cause", None) or f"{type(err).__name__}: {err}"
        _write_quietly(write, "failed", str(cause)[:300])
        raise
    write("ok")


def _write_quietly(write: Any, status: Status, reason: str) -> None:
    try:
        write(status, reason)
    except (OSError, LedgerError) as err:
        warnings.warn(f"ledger row not written: {err}", stacklevel=3)
