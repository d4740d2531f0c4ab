"""The run config's building blocks: constrained number types with one-line rules, and the
strict section base every config section derives from (an unknown field is an error)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict

Target = Literal["attention", "experts", "dense", "shared", "router"]
DEFAULT_TARGETS: tuple[Target, ...] = ("attention", "experts", "dense", "shared")


def _rule(ok: Callable[[Any], bool], rule: str) -> AfterValidator:
    """A numeric constraint whose error says what a valid value is (NaN never passes)."""

    def check(v: Any) -> Any:
        if not ok(v):
            raise ValueError(rule)
        return v

    check.__doc__ = rule  # read back where a field says what it accepts (CLI help)
    return AfterValidator(check)


def _finite(v: float) -> bool:
    return math.isfinite(v)


# Numbers a run config can hold; a value outside them cannot describe a real run.
# Counts past 64 bits overflow in torch and numpy (an "unexpected" error deep inside a build).
_INT64 = _rule(lambda v: v < 2**63, "must be below 2**63 (a 64-bit integer)")
PositiveInt = Annotated[int, _rule(lambda v: v > 0, "must be a positive integer (> 0)"), _INT64]
NonNegativeInt = Annotated[int, _rule(lambda v: v >= 0, "must be an integer >= 0"), _INT64]
# A LoRA rank above any model's width builds nothing a run could use (and 10**30 overflows).
LoraRank = Annotated[PositiveInt, _rule(lambda v: v <= 2**16, "must be at most 65536")]
PositiveFloat = Annotated[
    float, _rule(lambda v: _finite(v) and v > 0, "must be a finite number > 0")
]
NonNegativeFloat = Annotated[
    float, _rule(lambda v: _finite(v) and v >= 0, "must be a finite number >= 0")
]
FiniteFloat = Annotated[float, _rule(_finite, "must be a finite number")]
Fraction = Annotated[  # a share of the steps: 1.0 would be read by HF as "1 step"
    float, _rule(lambda v: _finite(v) and 0 <= v < 1, "must be a fraction in [0, 1)")
]
Percent = Annotated[
    float, _rule(lambda v: _finite(v) and 0 <= v <= 100, "must be a percentage in [0, 100]")
]
# An adapter on no part trains nothing (`--targets ,` was planned as if it were a run).
Targets = Annotated[
    list[Target], _rule(lambda v: len(v) > 0, "must name at least one part to train")
]
Port = Annotated[int, _rule(lambda v: 0 < v < 65536, "must be a TCP port (1-65535)")]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
