"""Rules on the eval ladder: every mistake `moetune eval` would stop at, found before the
training spend (the one check `moetune data` and the train preflight run too)."""

from __future__ import annotations

from moetune.data.rungs import ladder_problem
from moetune.lint.probes import ladder as probes
from moetune.lint.registry import Hit, LintContext, register_rule


@register_rule(
    "EVAL-LADDER",
    "error",
    "the eval ladder would fail only after training",
    probe=probes.ladder_passes_config,
)
def eval_ladder(ctx: LintContext) -> Hit | None:
    problem = ladder_problem(ctx.config.eval)
    if problem is None:
        return None
    return Hit(problem.cause, problem.fix, "eval.rungs")
