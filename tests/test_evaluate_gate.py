"""The gate's statistics: paired differences, Holm's step-down, the three outcomes per rung,
and verdicts that are never GO on too little evidence."""

from __future__ import annotations

import math

import pytest

from moetune.evaluate.gate import (
    RungRule,
    decide,
    holm_z,
    n_needed,
    paired,
    verdict_hash,
)


def test_paired_difference_and_standard_error() -> None:
    base = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    cand = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    stats = paired(base, cand, unit="neg_nll")  # no accuracy floor: the plain formula
    diffs = [0, 1, -1, 0, 1, 0]
    mean = sum(diffs) / 6
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 5)
    assert stats.delta == pytest.approx(1 / 6)
    assert stats.se == pytest.approx(sd / math.sqrt(6))
    assert (stats.base, stats.candidate) == (pytest.approx(4 / 6), pytest.approx(5 / 6))


def test_accuracy_spread_is_floored_at_one_discordant_item() -> None:
    stats = paired([1.0] * 50, [1.0] * 50)
    assert stats.delta == 0 and stats.se == pytest.approx(1 / 50)


def test_paired_needs_equal_non_empty_lists() -> None:
    with pytest.raises(ValueError):
        paired([1.0], [1.0, 0.0])
    with pytest.raises(ValueError):
        paired([], [])


def test_holm_levels_follow_the_p_value_order() -> None:
    out = holm_z([0.2, 0.001, 0.01], alpha=0.05)
    # smallest p tested at α/3, next at α/2, the largest at α
    assert out[1][0] == pytest.approx(2.1280, abs=1e-3)  # one-sided: Φ⁻¹(1 − 0.05/3)
    assert out[2][0] == pytest.approx(1.9600, abs=1e-3)
    assert out[0][0] == pytest.approx(1.6449, abs=1e-3)
    assert [rejected for _, rejected in out] == [False, True, True]


def test_holm_step_down_stops_at_the_first_non_rejection() -> None:
    # 0.03 > 0.05/2, so the step-down stops there: 0.04 (< 0.05 alone) is not rejected either
    out = holm_z([0.03, 0.04, 0.001], alpha=0.05)
    assert [rejected for _, rejected in out] == [False, False, True]


def protected(name: str = "kept", margin: float = 0.1, floor: float | None = None) -> RungRule:
    return RungRule(name, "protected", margin=margin, floor=floor)


def target(name: str = "new", min_gain: float = 0.2) -> RungRule:
    return RungRule(name, "target", min_gain=min_gain)


def test_unchanged_protected_and_learned_target_is_go() -> None:
    doc = decide(
        [target(), protected()],
        [paired([0.0] * 100, [1.0] * 90 + [0.0] * 10), paired([1.0] * 100, [1.0] * 100)],
    )
    assert doc["verdict"] == "GO"
    assert [r["status"] for r in doc["rungs"]] == ["pass", "pass"]
    assert doc["rungs"][1]["lower"] > -0.1


def test_a_clear_regression_on_a_protected_rung_is_no_go() -> None:
    doc = decide(
        [target(), protected("copy")],
        [paired([0.0] * 100, [1.0] * 100), paired([1.0] * 100, [1.0] * 60 + [0.0] * 40)],
    )
    assert doc["verdict"] == "NO-GO"
    copy = doc["rungs"][1]
    assert copy["status"] == "fail" and copy["upper"] < -0.1
    assert "copy" in doc["reason"]


def test_too_few_items_is_inconclusive_with_the_n_that_would_decide() -> None:
    doc = decide([protected()], [paired([1.0] * 5, [1.0] * 5)])
    assert doc["verdict"] == "INCONCLUSIVE"  # never GO on five items
    rung = doc["rungs"][0]
    assert rung["status"] == "inconclusive" and rung["n_needed"] > 5
    # at the needed n (same spread), the bound clears the margin
    z, sd = rung["z"], rung["se_delta"] * math.sqrt(5)
    assert z * sd / math.sqrt(rung["n_needed"]) <= 0.1 + 1e-12


def test_floor_fails_a_protected_rung_even_without_a_drop() -> None:
    doc = decide([protected(floor=0.9)], [paired([0.8] * 200, [0.8] * 200, unit="neg_nll")])
    assert doc["verdict"] == "NO-GO"
    assert "floor" in doc["rungs"][0]["reason"]


def test_target_gain_below_min_gain_fails() -> None:
    doc = decide([target(min_gain=0.5)], [paired([0.0] * 200, [1.0] * 40 + [0.0] * 160)])
    assert doc["rungs"][0]["status"] == "fail" and doc["verdict"] == "NO-GO"


def test_n_needed_none_when_estimate_sits_on_threshold() -> None:
    stats = paired([0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0])
    assert n_needed(stats, threshold=0.0, z=1.96) is None


def test_verdict_hash_covers_content() -> None:
    doc = decide([protected()], [paired([1.0] * 100, [1.0] * 100)])
    assert doc["hash"] == verdict_hash(doc)
    changed = {**doc, "verdict": "NO-GO"}
    assert verdict_hash(changed) != doc["hash"]


def test_gate_needs_a_rung() -> None:
    with pytest.raises(ValueError):
        decide([], [])


def test_a_verdict_short_of_go_says_what_to_do_next_inside_its_hash() -> None:
    """INCONCLUSIVE names the items that would decide (never a lower bar); NO-GO says not to
    promote; GO carries no fix. The fix is part of what the hash (and PROMOTED) vouches for."""
    open_ = decide([protected("kept")], [paired([1.0] * 5, [1.0] * 5)])
    needed = open_["rungs"][0]["n_needed"]
    assert f"kept about {needed} (has 5)" in open_["fix"] and "--limit" in open_["fix"]
    assert open_["hash"] == verdict_hash(open_)
    assert verdict_hash({**open_, "fix": "lower the margin"}) != open_["hash"]
    on_threshold = decide(
        [target("new", 0.0)], [paired([0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0])]
    )
    assert on_threshold["verdict"] == "INCONCLUSIVE" and "new more than 4" in on_threshold["fix"]
    failed = decide([protected("copy")], [paired([1.0] * 100, [1.0] * 60 + [0.0] * 40)])
    assert failed["fix"].startswith("do not promote") and "copy" in failed["fix"]
    assert "fix" not in decide([protected()], [paired([1.0] * 100, [1.0] * 100)])
