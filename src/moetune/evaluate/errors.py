"""Errors a user can cause in eval and gate: bad ladders, data, adapters, results dirs."""

from moetune.errors import MoetuneError


class EvalError(MoetuneError):
    """The ladder cannot be scored (no rungs, bad items, missing adapter, optional extra)."""


class GateError(MoetuneError):
    """The gate cannot decide or refuses (unreadable results, promote without GO)."""
