"""Errors a training run can stop with; each says what happened and how to fix it."""

from __future__ import annotations

from moetune.data.errors import DataError
from moetune.errors import MoetuneError

__all__ = ["DataError", "TrainError"]  # DataError lives with the data stage (moetune.data)


class TrainError(MoetuneError):
    """A run cannot start or continue as configured (preflight error, run dir, coverage)."""
