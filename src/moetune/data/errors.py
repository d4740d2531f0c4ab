"""The one error the data stage raises: it names the source and the row, and the fix."""

from __future__ import annotations

from moetune.errors import MoetuneError


class DataError(MoetuneError):
    """The training data cannot be used: missing, empty, malformed or mixed rows."""


class TokenizerError(DataError):
    """The run's tokenizer cannot carry it: missing, empty, wider than the model, or with no
    chat template for message rows (data/tokenizer.py)."""
