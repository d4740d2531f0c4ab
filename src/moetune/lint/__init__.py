"""Lint: every known trap as a rule with an id, a message, a fix and a live probe.

It sits above model/, plan/ and recipe/ (the rules read the spec, the plan and the recipe)
and below train/ (which lints before it builds anything). The registry (registry.py) imports
none of its rules; importing the package registers them all here.
"""

from moetune.lint import rules  # noqa: F401  (registers every rule)
from moetune.lint.registry import RULES, LintContext, lint, rule_table

__all__ = ["RULES", "LintContext", "lint", "rule_table"]
