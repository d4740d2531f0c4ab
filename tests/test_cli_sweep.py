"""The sweep's verdicts (benchmarks/cli_sweep.py): what makes a case BAD or WEAK is what
issue 26 asks of the CLI, so a classifier that let one through would hide a regression."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from sweep_cases import Case, all_cases, classify
from sweep_fresh import fresh_cases

BAD_INPUT = Case("x", ["plan", "run.yaml", "--json"])
LEGAL = Case("y", ["plan", "run.yaml", "--json"], expect="good")
ONE_LINE = "error: lora.rank: must be a positive integer (> 0) fix: set lora.rank to 8\n"


@pytest.mark.parametrize(
    ("case", "code", "out", "err", "verdict", "why"),
    [
        (BAD_INPUT, 2, "", ONE_LINE, "OK", ""),
        (BAD_INPUT, 0, "{}", "", "BAD", "exit 0 on bad input"),
        (BAD_INPUT, 2, "", "error: lora.rank is wrong\n", "BAD", "refused without a fix"),
        (
            BAD_INPUT,
            3,
            "",
            "error: unexpected TypeError: x hint: --debug\n",
            "BAD",
            "exit 3: unexpected",
        ),
        (BAD_INPUT, None, "", "", "BAD", "timeout"),
        (
            BAD_INPUT,
            2,
            "",
            "Traceback (most recent call last):\n fix\n",
            "BAD",
            "exit 2: unexpected",
        ),
        (BAD_INPUT, 2, "", ONE_LINE + ONE_LINE, "WEAK", "2 lines of error"),
        (LEGAL, 0, "not json", "", "WEAK", "--json printed no JSON"),
        (LEGAL, 2, "", ONE_LINE, "WEAK", "a legal input refused"),
        (LEGAL, 1, "", "fix: restore the lines\n", "OK", ""),
    ],
)
def test_each_class_of_outcome(
    case: Case, code: int | None, out: str, err: str, verdict: str, why: str
) -> None:
    assert classify(case, code, out, err) == (verdict, why)


def test_the_sweep_has_at_least_150_cases_with_unique_names() -> None:
    cases = all_cases(fuzz=60, garble=30)
    assert len(cases) >= 150 and len({c.name for c in cases}) == len(cases)
    fresh = fresh_cases()  # the third pass's (issue 36): ≥ 150 new ones, no name reused
    assert len(fresh) >= 150 and not {c.name for c in fresh} & {c.name for c in cases}
    assert {c.expect for c in cases} == {"bad", "good", "any"}
