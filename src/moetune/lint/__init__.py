"""Lint: every known trap as a rule with an id, a message, a fix and a live probe.

It sits above model/, plan/ and recipe/ (the rules read the spec, the plan and the recipe)
and below train/ (which lints before it builds anything). The registry (rules.py) imports
none of its rules; importing the package registers them all here.
"""

from moetune.lint import (  # noqa: F401
    rules_dist,
    rules_infra,
    rules_mlx,
    rules_model,
    rules_offload,
    rules_peft,
    rules_serve,
    rules_stored,
)
from moetune.lint.rules import RULES, LintContext, lint, rule_table

__all__ = ["RULES", "LintContext", "lint", "rule_table"]
