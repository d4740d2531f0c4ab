"""Evaluate and promote: the eval ladder (base vs candidate on the same items, per item),
the promotion gate (paired non-inferiority / superiority, Holm across rungs) and promotion."""

from moetune.evaluate import lmeval as _lmeval  # noqa: F401  (registers the lm_eval rung kind)
from moetune.evaluate.errors import EvalError, GateError
from moetune.evaluate.gate import decide, gate_results, paired, promote
from moetune.evaluate.ladder import run_eval
from moetune.evaluate.rungs import RUNG_KINDS, ItemScore, Rung, make_rung, register_rung
from moetune.io import PROMOTED

__all__ = [
    "PROMOTED",
    "RUNG_KINDS",
    "EvalError",
    "GateError",
    "ItemScore",
    "Rung",
    "decide",
    "gate_results",
    "make_rung",
    "paired",
    "promote",
    "register_rung",
    "run_eval",
]
