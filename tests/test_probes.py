"""Every rule's trap, demonstrated on the installed libraries.

A probe that stops reproducing its trap fails here: the library fixed (or moved) the
behaviour the rule warns about, so the rule needs a review – never a silent pass.
"""

from __future__ import annotations

import os

import pytest

from moetune.lint.registry import RULES, ProbeUnavailable, versions_of


@pytest.mark.parametrize("rule_id", sorted(RULES))
def test_trap_still_reproduces(rule_id: str) -> None:
    rule = RULES.get(rule_id)
    try:
        outcome = rule.probe()
    except ProbeUnavailable as why:
        if rule_id.startswith("MLX-") and os.environ.get("MOETUNE_REQUIRE_MLX") == "1":
            pytest.fail(f"{rule_id} must run here (CI installs the mlx extra): {why}")
        pytest.skip(f"{rule_id}: {why}")
    assert outcome.evidence, f"{rule_id}: a probe must say what it saw"
    if not outcome.trap_present:
        pytest.fail(
            f"trap {rule_id} no longer reproduces on {versions_of(rule.libraries)} – review "
            f"the rule. Evidence: {outcome.evidence}"
        )


def test_family_peft_automap_flags_match_installed_peft() -> None:
    """Override.peft_automap ("peft maps gate/up/down_proj onto the experts") must say what
    the installed peft does."""
    from moetune.model import OVERRIDES, get_family
    from moetune.recipe.targets import peft_name_map

    glu = {"gate_proj", "up_proj", "down_proj"}
    wrong = {
        key: over.peft_automap
        for key, over in OVERRIDES.items()
        if get_family(key).paths.expert_params  # dense families: the flag means nothing
        and over.peft_automap != (glu <= set(peft_name_map(key)))
    }
    assert not wrong, (
        f"Override.peft_automap disagrees with {versions_of(('peft', 'transformers'))} for "
        f"{wrong} (the flag as set; the installed peft says the opposite)"
    )
