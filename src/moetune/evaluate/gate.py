"""The promotion gate: paired base-vs-candidate differences, decided per rung, Holm across rungs.

For every rung, d_i = candidate_i − base_i over the same items; Δ = mean(d) and
SE_Δ = sd(d)/√n. Each rung has a threshold – −margin for a protected rung (non-inferiority),
min_gain for a target rung – and the rung's null hypothesis "Δ does not clear the
threshold" gets a one-sided p-value. Holm's step-down assigns each rung its z (the
smallest p is tested at α/m, the next at α/(m−1), …), so the family-wise error across the
ladder stays ≤ α. With that z:

    pass          Δ − z·SE_Δ clears the threshold (and, when protected, the candidate's score
                  reaches its absolute floor) and Holm's step-down reached the rung
    fail          Δ + z·SE_Δ is below the threshold (confidently worse), or below the floor
    inconclusive  otherwise: the bounds straddle the threshold; `n_needed` says how many
                  items would decide at the observed spread

GO only when every rung passes; NO-GO when any fails; INCONCLUSIVE otherwise – never GO.
For accuracy rungs the spread is floored at one discordant item in n, so perfect agreement
on a handful of items never reads as certainty.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any, Literal

from pydantic import ValidationError

from moetune.config import GateArgs
from moetune.errors import clip
from moetune.evaluate.errors import GateError
from moetune.evaluate.results import (
    RungDoc,
    evaluated_adapter,
    read_items,
    read_json,
    read_ladder,
    worst_items,
)
from moetune.io import PROMOTED, adapter_files, atomic_write_json, digest_matches
from moetune.ledger import Ledger, LedgerRow, Status
from moetune.model.finite import require_finite_adapter

RungStatus = Literal["pass", "fail", "inconclusive"]
Verdict = Literal["GO", "NO-GO", "INCONCLUSIVE"]
_NORMAL = NormalDist()


@dataclass(frozen=True)
class Paired:
    n: int
    base: float  # mean base score
    candidate: float  # mean candidate score
    delta: float
    se: float  # SE of the mean paired difference


def paired(base: list[float], candidate: list[float], unit: str = "accuracy") -> Paired:
    """Mean paired difference and its standard error (sample sd, ddof 1)."""
    n = len(base)
    if n == 0 or n != len(candidate):
        raise ValueError("paired scores need the same, non-zero number of items")
    diffs = [c - b for b, c in zip(base, candidate, strict=True)]
    delta = sum(diffs) / n
    var = sum((d - delta) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    if unit == "accuracy":
        var = max(var, 1.0 / n)  # one discordant item: the least spread n items can rule out
    return Paired(n, sum(base) / n, sum(candidate) / n, delta, math.sqrt(var / n))


@dataclass(frozen=True)
class RungRule:
    """What a rung must show (from its config)."""

    name: str
    role: Literal["target", "protected"]
    margin: float = 0.1
    floor: float | None = None
    min_gain: float = 0.05

    @property
    def threshold(self) -> float:
        return self.min_gain if self.role == "target" else -self.margin


@dataclass(frozen=True)
class RungDecision:
    name: str
    role: str
    status: RungStatus
    n: int
    base_score: float
    candidate_score: float
    delta: float
    se_delta: float
    z: float
    lower: float
    upper: float
    threshold: float
    n_needed: int | None
    reason: str


def p_value(stats: Paired, threshold: float) -> float:
    """One-sided p of "Δ does not clear the threshold" (normal approximation)."""
    if stats.se == 0:
        return 0.0 if stats.delta > threshold else 1.0
    return 1.0 - _NORMAL.cdf((stats.delta - threshold) / stats.se)


def holm_z(p_values: list[float], alpha: float) -> list[tuple[float, bool]]:
    """Per rung: the z its bound uses under Holm's step-down, and whether it was rejected."""
    order = sorted(range(len(p_values)), key=p_values.__getitem__)
    out: list[tuple[float, bool]] = [(0.0, False)] * len(p_values)
    still = True
    for k, i in enumerate(order):
        level = alpha / (len(p_values) - k)
        still = still and p_values[i] <= level
        out[i] = (_NORMAL.inv_cdf(1.0 - level), still)
    return out


def n_needed(stats: Paired, threshold: float, z: float) -> int | None:
    """Items that would put z·SE inside the gap between Δ and the threshold."""
    gap = abs(stats.delta - threshold)
    if gap == 0:
        return None  # the estimate sits on the threshold: no n decides it
    sd = stats.se * math.sqrt(stats.n)
    return max(math.ceil((z * sd / gap) ** 2), stats.n + 1)


def decide_rung(rule: RungRule, stats: Paired, z: float, rejected: bool) -> RungDecision:
    thr = rule.threshold
    lower, upper = stats.delta - z * stats.se, stats.delta + z * stats.se
    below_floor = rule.role == "protected" and rule.floor is not None
    below_floor = below_floor and stats.candidate < (rule.floor or 0.0)
    what = "−margin" if rule.role == "protected" else "min_gain"
    bounds = f"Δ {stats.delta:+.3f}, bounds [{lower:+.3f}, {upper:+.3f}] at z {z:.2f}"
    needed: int | None = None
    status: RungStatus
    if below_floor:
        status, reason = "fail", f"candidate {stats.candidate:.3f} below floor {rule.floor}"
    elif upper < thr:
        status, reason = "fail", f"{bounds}: upper bound below {what} {thr:+.3f}"
    elif rejected:
        status, reason = "pass", f"{bounds}: lower bound clears {what} {thr:+.3f}"
    else:
        status, needed = "inconclusive", n_needed(stats, thr, z)
        more = f"; about {needed} items would decide" if needed else ""
        reason = f"{bounds}: straddle {what} {thr:+.3f}{more}"
    return RungDecision(
        rule.name, rule.role, status, stats.n, stats.base, stats.candidate,
        stats.delta, stats.se, z, lower, upper, thr, needed, reason,
    )  # fmt: skip


def verdict_of(decisions: list[RungDecision]) -> tuple[Verdict, str]:
    """The verdict and one line naming the rungs that decided it (details per rung)."""
    failed = [d for d in decisions if d.status == "fail"]
    open_ = [d for d in decisions if d.status == "inconclusive"]
    if not failed and not open_:
        return "GO", f"all {len(decisions)} rungs pass"
    verdict: Verdict = "NO-GO" if failed else "INCONCLUSIVE"
    which = failed or open_
    status = "fail" if failed else "inconclusive"
    names = ", ".join(f"{d.name} ({d.role}, Δ {d.delta:+.3f})" for d in which)
    return verdict, f"{len(which)} of {len(decisions)} rungs {status}: {names}"


def next_step(decisions: list[RungDecision]) -> str:
    """What to do after a verdict that is not GO: fix a failing candidate; score more items
    where bounds straddle (never lower the bar to get a verdict)."""
    failed = [d.name for d in decisions if d.status == "fail"]
    if failed:
        worse = ", ".join(failed)
        return (f"do not promote: the candidate confidently misses the bar on {worse}; see its "
                "worst items, change the data or training, retrain and eval again")  # fmt: skip
    open_ = [d for d in decisions if d.status == "inconclusive"]
    sizes = ", ".join(f"{d.name} about {d.n_needed} (has {d.n})" if d.n_needed else
                      f"{d.name} more than {d.n}" for d in open_)  # fmt: skip
    return (f"score more items to decide ({sizes}): add items to the rung's data, or raise "
            "--limit / eval.limit if it cut them, then eval again")  # fmt: skip


def decide(rules: list[RungRule], stats: list[Paired], alpha: float = 0.05) -> dict[str, Any]:
    """The verdict document: verdict, reason, alpha, per-rung decisions and its own hash."""
    if not rules:
        raise ValueError("a gate needs at least one rung")
    p = [p_value(s, r.threshold) for r, s in zip(rules, stats, strict=True)]
    zs = holm_z(p, alpha)
    decisions = [
        decide_rung(rule, s, z, ok) for rule, s, (z, ok) in zip(rules, stats, zs, strict=True)
    ]
    verdict, reason = verdict_of(decisions)
    doc: dict[str, Any] = {
        "verdict": verdict,
        "reason": reason,
        "alpha": alpha,
        "rungs": [asdict(d) for d in decisions],
    }
    if verdict != "GO":  # what to do next; derived from the decisions, so inside the hash
        doc["fix"] = next_step(decisions)
    doc["hash"] = verdict_hash(doc)
    return doc


def verdict_hash(doc: dict[str, Any]) -> str:
    """sha256 of the verdict's canonical JSON (without its own hash field)."""
    body = {k: v for k, v in doc.items() if k != "hash"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------- results dirs and promotion


def read_pairs(results: Path, rung: RungDoc) -> Paired:
    """The rung's paired statistics, recomputed from its per-item file (the source of truth)
    once that file is shown to hold exactly the ladder's items."""
    rows = read_items(results, rung)
    return paired([r.base for r in rows], [r.candidate for r in rows], rung.unit)


def rule_of(rung: RungDoc) -> RungRule:
    a = rung.args
    return RungRule(a.name, a.role, a.margin, a.floor, a.min_gain)


def gate_results(
    results: Path | str, alpha: float | None = None, ledger: str | Path | None = None
) -> dict[str, Any]:
    """Decide from a results dir; writes verdict.json there and a `gate` ledger row."""
    results = Path(results)
    given = checked_alpha(alpha)
    ladder, checked = read_ladder(results)
    alpha = given if given is not None else checked.gate.alpha
    rungs = checked.rungs
    doc = decide([rule_of(r) for r in rungs], [read_pairs(results, r) for r in rungs], alpha)
    doc = with_examples(results, rungs, doc)
    doc = {**doc, "adapter": checked.adapter, "adapter_sha256": checked.adapter_sha256}
    doc["hash"] = verdict_hash(doc)
    atomic_write_json(results / "verdict.json", doc)
    metrics = {"verdict": doc["verdict"], "hash": doc["hash"], "results": str(results)}
    record(ladder, ledger, "gate", metrics, doc["reason"], GATE_STATUS[doc["verdict"]])
    return doc


def checked_alpha(alpha: Any) -> float | None:
    """--alpha as gate.alpha takes it (a rate in (0, 0.5)): an alpha of 1 or NaN would
    decide a verdict on bounds no rung can fail – a GO nobody asked for."""
    if alpha is None:
        return None
    try:
        return GateArgs(alpha=alpha).alpha
    except ValidationError:
        raise GateError(f"--alpha {clip(repr(alpha), 40)} is not a family-wise error rate "
                        "in (0, 0.5)", "pass --alpha 0.05 (or leave it out: the ladder's)"
                        ) from None  # fmt: skip


# the gate row's ledger status: a NO-GO is the gate working, but never an `ok` adapter
GATE_STATUS: dict[str, Status] = {"GO": "ok", "NO-GO": "no-go", "INCONCLUSIVE": "inconclusive"}
EXAMPLES = 3  # items shown per failing rung


def with_examples(results: Path, rungs: list[RungDoc], doc: dict[str, Any]) -> dict[str, Any]:
    """The verdict with, per failing rung, a few of its items as the models answered them
    (prompt, expected, base and candidate output) – the worst-scored first."""
    failing = {d["name"] for d in doc["rungs"] if d["status"] == "fail"}
    for rung, decision in zip(rungs, doc["rungs"], strict=True):
        if rung.name in failing:
            decision["examples"] = worst_items(results, rung, EXAMPLES)
    return doc


def record(
    ladder: dict[str, Any], ledger: str | Path | None, kind: str, metrics: dict[str, Any],
    reason: str = "", status: Status = "ok",
) -> None:  # fmt: skip
    """A ledger row for this ladder's run (the run's ledger unless another is given)."""
    Ledger(ledger or ladder["ledger"]).append(
        LedgerRow(
            kind=kind,
            status=status,
            run_id=ladder.get("run_id"),
            config_hash=ladder.get("config_hash"),
            metrics=metrics,
            reason=reason[:300],
        )
    )


def promote(
    results: Path | str, ledger: str | Path | None = None, adapter: Path | None = None
) -> Path:
    """Mark the adapter promoted – only on a GO verdict for exactly these adapter bytes.
    `adapter`: a copy of the evaluated one (e.g. banked off a pod); its bytes must match.
    Without it, the adapter beside `results` (see `evaluated_adapter`)."""
    results = Path(results)
    verdict = read_json(results / "verdict.json")
    if verdict.get("hash") != verdict_hash(verdict):
        raise GateError(
            f"{results}/verdict.json was edited after the gate", "re-run `moetune gate`"
        )
    if verdict["verdict"] != "GO":
        raise GateError(
            f"not promoted: the verdict is {verdict['verdict']} ({verdict['reason']})",
            "only a GO verdict promotes; see the per-rung reasons above",
        )
    adapter = adapter or evaluated_adapter(results, read_ladder(results)[1])
    if not digest_matches(adapter, verdict["adapter_sha256"]):
        raise GateError(
            f"{adapter} changed since it was evaluated",
            "re-run `moetune eval` on the adapter as it is now",
        )
    require_finite_adapter(adapter)  # a GO scored on NaN weights promotes nothing
    marker = adapter / PROMOTED
    body = {"verdict_hash": verdict["hash"], "results": str(results.resolve()),
            "adapter_sha256": verdict["adapter_sha256"], "time": time.time(),
            "files": adapter_files(adapter)}  # each file's: a later change is named  # fmt: skip
    atomic_write_json(marker, body)
    metrics = {"adapter": str(adapter), "verdict_hash": verdict["hash"]}
    record(read_json(results / "ladder.json"), ledger, "promote", metrics)
    return marker
