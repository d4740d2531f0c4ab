"""Each rank's measured peak under `train.strategy ep`, beside the plan's per-rank figure.

summary.json's `memory` compares the main rank's peak with the plan (plan/run_plan.py:
`per_rank`, one rank's share plus – off CUDA – the process baseline). Under ep the ranks
hold different experts and receive different token counts, so every rank's own peak is
recorded in its `distributed.expert_parallel` entry (measured as the main rank's is: CUDA's
peak allocated, else the process's peak RSS since the first step, VmHWM reset there) with
its ratio to the same planned figure.
"""

from __future__ import annotations

from typing import Any

from moetune.train.callbacks import peak_memory


def rank_peak() -> dict[str, Any]:
    """This rank's peak since the first step, and what was measured."""
    peak, how = peak_memory()
    return {"peak_memory_bytes": peak, "measured": how}


def against_plan(ran: dict[str, Any] | None, planned: int | None) -> dict[str, Any] | None:
    """`ran` (launch.sharding's figures) with each ep rank's peak over `planned`."""
    ranks = (ran or {}).get("expert_parallel") or []
    for entry in ranks:
        if planned and "peak_memory_bytes" in entry:
            entry["planned_peak_bytes"] = planned
            entry["measured_over_planned"] = round(entry["peak_memory_bytes"] / planned, 4)
    return ran
