"""The report's view of a NO-GO: per failing rung, the few items the gate kept (the
verdict's `examples`: prompt, expected, base and candidate output)."""

from __future__ import annotations

from typing import Any

from moetune.errors import clip


def _or_dash(value: Any) -> Any:
    return "–" if value is None else value  # a kind whose items hold no prompt (lm_eval)


def failing_examples(verdict: dict[str, Any]) -> list[dict[str, str]]:
    """Per failing rung, the few items the gate kept (prompt, expected, base and candidate
    output), each cell clipped to one readable line."""
    keys = ("i", "prompt", "expected", "base_output", "candidate_output")
    return [
        {"rung": str(r.get("name")), **{k: clip(_or_dash(ex.get(k)), 200) for k in keys}}
        for r in verdict["rungs"]
        for ex in (r.get("examples") or [])
        if isinstance(ex, dict)
    ]
