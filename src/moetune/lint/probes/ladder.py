"""Probes of the eval ladder's traps: what the config accepts that only `moetune eval` – after
the training spend – would refuse."""

from __future__ import annotations

from moetune.config import parse_config
from moetune.lint.registry import ProbeOutcome


def ladder_passes_config() -> ProbeOutcome:
    """A mistyped rung kind and a rung file that does not exist pass the config's own
    validation: nothing but a check of the ladder stops them before the eval."""
    rung = {"name": "skill", "kind": "exact-match", "data": "no/such/rung.jsonl"}
    cfg = parse_config({"eval": {"rungs": [rung]}})
    got = cfg.eval.rungs[0]
    return ProbeOutcome(
        got.kind == "exact-match",
        f"parse_config accepted eval.rungs[0] kind {got.kind!r}, data {got.data!r}",
    )
