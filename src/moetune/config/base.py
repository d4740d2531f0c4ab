"""The run config's building blocks: constrained number types with one-line rules, and the
strict section base every config section derives from (an unknown field is an error)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

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


def _not_bool(v: Any) -> Any:
    """pydantic reads true / false as 1 / 0 in a number field: `--set train.learning_rate=true`
    would train at a rate of 1.0, so a boolean is no number here."""
    if isinstance(v, bool):
        raise ValueError("must be a number, not true / false")
    return v


_NUMBER = BeforeValidator(_not_bool)


def _finite(v: float) -> bool:
    return math.isfinite(v)


# Numbers a run config can hold; a value outside them cannot describe a real run.
# Counts past 64 bits overflow in torch and numpy (an "unexpected" error deep inside a build).
_INT64 = _rule(lambda v: v < 2**63, "must be below 2**63 (a 64-bit integer)")
PositiveInt = Annotated[
    int, _NUMBER, _rule(lambda v: v > 0, "must be a positive integer (> 0)"), _INT64
]
NonNegativeInt = Annotated[int, _NUMBER, _rule(lambda v: v >= 0, "must be an integer >= 0"), _INT64]
# A LoRA rank above any model's width builds nothing a run could use (and 10**30 overflows).
LoraRank = Annotated[PositiveInt, _rule(lambda v: v <= 2**16, "must be at most 65536")]
PositiveFloat = Annotated[
    float, _NUMBER, _rule(lambda v: _finite(v) and v > 0, "must be a finite number > 0")
]
NonNegativeFloat = Annotated[
    float, _NUMBER, _rule(lambda v: _finite(v) and v >= 0, "must be a finite number >= 0")
]
FiniteFloat = Annotated[float, _NUMBER, _rule(_finite, "must be a finite number")]
Fraction = Annotated[  # a share of the steps: 1.0 would be read by HF as "1 step"
    float, _NUMBER, _rule(lambda v: _finite(v) and 0 <= v < 1, "must be a fraction in [0, 1)")
]
Percent = Annotated[
    float,
    _NUMBER,
    _rule(lambda v: _finite(v) and 0 <= v <= 100, "must be a percentage in [0, 100]"),
]


def _gb_within(bounds: tuple[float, float], what: str) -> AfterValidator:
    """A size in GB held to `bounds`: past them it is a typo (bytes given as GB, 1e300), and
    a plan on it would fit anything (or, at inf / nan, nothing) without a word."""
    low, high = bounds
    return _rule(lambda v: low <= v <= high, f"must be {what} in GB ({low:g} to {high:,.0f})")


# An unlisted card's memory: below 1 GB or past 10 TB it is a typo (1e9 for 1e9 bytes …),
# and its name (`f"{gb:g}GB"`, "1e+09GB") would no longer read back as a memory.
CARD_MEMORY_GB = (1.0, 10_000.0)
CardMemory = Annotated[float, _NUMBER, _gb_within(CARD_MEMORY_GB, "a card's memory")]
# A node's RAM: the largest servers hold tens of TB; 100 TB per node is past any of them.
HOST_RAM_GB = (1.0, 100_000.0)
HostRam = Annotated[float, _NUMBER, _gb_within(HOST_RAM_GB, "a node's RAM")]
# A disk (free space, a pod's volume): 1 PB per node is past any one node's disks.
DISK_GB = (1.0, 1_000_000.0)
DiskSize = Annotated[float, _NUMBER, _gb_within(DISK_GB, "a disk's size")]
DiskSizeInt = Annotated[int, _NUMBER, _gb_within(DISK_GB, "a disk's size")]
# An adapter on no part trains nothing (`--targets ,` was planned as if it were a run).
Targets = Annotated[
    list[Target], _rule(lambda v: len(v) > 0, "must name at least one part to train")
]
Port = Annotated[int, _NUMBER, _rule(lambda v: 0 < v < 65536, "must be a TCP port (1-65535)")]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
