"""Errors a user can cause. Each carries a one-line cause and a fix; the CLI prints
them without a traceback and exits non-zero."""

from __future__ import annotations

import errno


class MoetuneError(Exception):
    """Base class: `cause` says what went wrong, `fix` what to do about it."""

    exit_code = 2

    def __init__(self, cause: str, fix: str = "") -> None:
        self.cause = cause
        self.fix = fix
        super().__init__(f"{cause} Fix: {fix}" if fix else cause)


class ConfigError(MoetuneError):
    """A run config, option or model config.json is invalid."""


class ModelSourceError(MoetuneError):
    """A model id or path cannot be resolved to a config.json."""


class UnknownFamilyError(MoetuneError):
    """A model_type moetune does not know."""


class UnknownCardError(MoetuneError):
    """A hardware id that is not in the card catalog."""


class RecipeError(MoetuneError):
    """A LoRA recipe cannot be built as asked (e.g. expert targets on a dense model)."""


class TraceError(MoetuneError):
    """The fake-tensor trace of a training step failed."""


def clip(text: object, limit: int = 160) -> str:
    """`text` on one line and at most `limit` characters: a 5000-character path or a
    multi-line library message must not turn a one-line error into a wall."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else f"{flat[: limit - 1]}…"


def os_problem(err: OSError) -> str:
    """Why a path cannot be used, in words (no errno numbers, no 5000-character echo)."""
    if isinstance(err, FileNotFoundError):
        return "not found"
    if isinstance(err, IsADirectoryError):
        return "is a directory, not a file"
    if err.errno == errno.ENAMETOOLONG:
        return f"the path is too long ({len(str(err.filename or ''))} characters)"
    return err.strerror or type(err).__name__
