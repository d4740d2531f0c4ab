"""GM-1's results over seeds: CE intervals, MoE-vs-dense gaps, routing health, the plot.

Gaps are reported two ways: the gap of the seed means, and a t-interval over the per-seed
paired gaps (arms of one seed share the corpus order, so the pairing removes the corpus's
share of the seed-to-seed noise).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moetune.bench.stats import gap_pct, t_interval

SMOOTH = 10  # steps in the moving average of the plotted training loss


def _by_arm(raw: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for run in raw["runs"]:
        out.setdefault(run["arm"], []).append(run)
    return out


def _routing(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per layer over seeds: mean entropy, worst max load, dead experts, collapsed seeds."""
    layers: dict[int, list[dict[str, Any]]] = {}
    for run in runs:
        for load in run["routing"]:
            layers.setdefault(load["layer"], []).append(load)
    return [
        {
            "layer": layer,
            "entropy_mean": round(sum(x["entropy"] for x in seen) / len(seen), 4),
            "entropy_min": min(x["entropy"] for x in seen),
            "max_fraction_max": max(x["max_fraction"] for x in seen),
            "top1_share_max": max(x["top1_share"] for x in seen),
            "dead_experts_per_seed": [len(x["dead_experts"]) for x in seen],
            "collapsed_seeds": sum(bool(x["collapsed"]) for x in seen),
        }
        for layer, seen in sorted(layers.items())
    ]


def _gap(runs: list[dict[str, Any]], dense: list[dict[str, Any]]) -> dict[str, Any]:
    dense_ce = {r["seed"]: r["final_ce"] for r in dense}
    paired = [gap_pct(r["final_ce"], dense_ce[r["seed"]]) for r in runs if r["seed"] in dense_ce]
    means = t_interval([r["final_ce"] for r in runs]).mean, t_interval(list(dense_ce.values()))
    return {
        "of_means_pct": round(gap_pct(means[0], means[1].mean), 3),
        "paired_pct": t_interval(paired).to_json(3) if paired else None,
    }


def _arm(name: str, runs: list[dict[str, Any]], raw: dict[str, Any], dense: Any) -> Any:
    tps = [r["tokens_per_s"] for r in runs if r["tokens_per_s"]]
    out = {
        "params": raw["models"][name],
        "heldout_ce": t_interval([r["final_ce"] for r in runs]).to_json(),
        "init_ce_mean": round(sum(r["init_ce"] for r in runs) / len(runs), 5),
        "tokens_per_s": round(sum(tps) / len(tps), 1) if tps else None,
        "train_s_mean": round(sum(r["train_s"] for r in runs) / len(runs), 2),
        "seeds": [r["seed"] for r in runs],
    }
    if name != "dense":
        out["gap_vs_dense"] = _gap(runs, dense)
        out["routing"] = _routing(runs)
    return out


def curves(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Seed-mean held-out CE per eval step, and the smoothed seed-mean training loss."""
    steps = [s for s, _ in runs[0]["curve"]]
    held = [sum(r["curve"][i][1] for r in runs) / len(runs) for i in range(len(steps))]
    n = min(len(r["train_loss"]) for r in runs)
    train = [sum(r["train_loss"][i] for r in runs) / len(runs) for i in range(n)]
    windows = [train[max(0, i - SMOOTH + 1) : i + 1] for i in range(n)]
    smooth = [sum(w) / len(w) for w in windows]
    return {"steps": steps, "heldout_ce": [round(v, 5) for v in held],
            "train_loss_smoothed": [round(v, 4) for v in smooth]}  # fmt: skip


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """The results a person reads: per arm, over seeds (raw runs kept under `runs`)."""
    by_arm = _by_arm(raw)
    dense = by_arm.get("dense", [])
    arms = {name: _arm(name, runs, raw, dense) for name, runs in by_arm.items()}
    return {**raw, "arms": arms, "curves": {n: curves(r) for n, r in by_arm.items()}}


def plot(summary: dict[str, Any], path: Path) -> Path:
    """Loss curves (held-out CE at eval steps, smoothed training CE) as a PNG; the file is
    written beside `path` first and renamed, so it is never half-written."""
    # lazy: heavy to import (matplotlib, jinja2 via moetune.report)
    from moetune.report.plots import new_figure

    fig = new_figure(10, 4)
    held_ax, train_ax = fig.subplots(1, 2)
    tokens = summary["config"]["size_spec"]["batch"] * summary["config"]["size_spec"]["seq"]
    for name, c in summary["curves"].items():
        held_ax.plot([s * tokens for s in c["steps"]], c["heldout_ce"], marker="o", label=name)
        train_ax.plot(range(1, len(c["train_loss_smoothed"]) + 1), c["train_loss_smoothed"],
                      label=name)  # fmt: skip
    _label(held_ax, "training tokens", "held-out CE (seed mean)")
    _label(train_ax, "step", f"training CE ({SMOOTH}-step mean)")
    fig.suptitle(f"GM-1, size {summary['config']['size']}, {summary['config']['seeds']} seed(s)")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        tmp.replace(path)
    finally:
        fig.clear()
        tmp.unlink(missing_ok=True)
    return path


def _label(ax: Any, x: str, y: str) -> None:
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def verdict(summary: dict[str, Any]) -> Sequence[str]:
    """One line per MoE arm: its gap to dense and whether the interval excludes zero."""
    lines = []
    for name, arm in summary["arms"].items():
        gap = arm.get("gap_vs_dense")
        if not gap:
            continue
        paired = gap["paired_pct"] or {}
        low, high = paired.get("low"), paired.get("high")
        if low is None or high is None:
            word = "one seed: no interval"
        else:
            word = "worse" if low > 0 else "better" if high < 0 else "no clear difference"
        lines.append(f"{name}: {gap['of_means_pct']:+.2f} % CE vs dense ({word})")
    return lines
