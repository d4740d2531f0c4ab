"""Errors a training run can stop with; each says what happened and how to fix it."""

from __future__ import annotations

from moetune.errors import MoetuneError


class TrainError(MoetuneError):
    """A run cannot start or continue as configured (preflight error, run dir, coverage)."""


class DataError(TrainError):
    """The training data cannot be used: missing, empty, malformed or mixed rows."""
