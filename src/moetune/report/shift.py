"""The report's "Routing shift" section (train.method grpo): per step, the share of tokens
whose top-k expert set differs between the rollout pass and the training pass
(RUN_DIR/routing_shift.jsonl, written by train/grpo/shift.py) – the known source of MoE
RL instability – against the train.grpo.shift_warn line, and per layer the set and
first-choice shares."""

from __future__ import annotations

from typing import Any

import moetune.report.plots as plots
from moetune.report.inputs import lookup, missing, read_jsonl


def shift_section(inp: Any) -> dict[str, Any]:
    path = inp.run_dir / "routing_shift.jsonl"
    if not path.is_file():  # a method that does not sample: nothing is missing
        return {"hint": "the method samples no rollouts (only grpo does)", "plot": None}
    rows = [r for r in read_jsonl(path) if isinstance(r.get("layers"), list)]
    if not rows:
        return missing(f"no routing-shift records in {path} yet")
    warn_at = lookup(inp.config, "train.grpo.shift_warn")
    steps, mean, layers = shift_series(rows)
    over = sorted(layer for layer, shares in layers.items() if warn_at and max(shares) > warn_at)
    shown = plots.pick_layers(sorted(layers))
    caption = (
        f"{len(steps)} steps; mean shift {sum(mean) / len(mean):.2%}, worst step "
        f"{max(mean):.2%}; {len(layers)} MoE layers"
        + (f", showing {len(shown)}" if len(shown) < len(layers) else "")
    )
    return {
        "hint": "",
        "caption": caption,
        "over": over,
        "warn_at": warn_at,
        "plot": plots.shift_plot(steps, mean, {k: layers[k] for k in shown}, warn_at),
        "layers": layer_table(rows),
        "replay": lookup(inp.config, "train.grpo.routing_replay"),
    }


def layer_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per MoE layer over all records: the token-weighted top-k set and top-1 shift, the
    worst step's set shift (top-1 None where the records predate it)."""
    seen: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        for entry in row["layers"]:
            seen.setdefault(int(entry["layer"]), []).append(entry)
    return [_layer_row(layer, entries) for layer, entries in sorted(seen.items())]


def _layer_row(layer: int, entries: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(int(e["tokens"]) for e in entries) or 1
    top1 = [e for e in entries if "top1_shift" in e]
    return {
        "layer": layer,
        "tokens": tokens,
        "shift": sum(e["shift"] * e["tokens"] for e in entries) / tokens,
        "worst": max(float(e["shift"]) for e in entries),
        "top1": sum(e["top1_shift"] * e["tokens"] for e in top1) / tokens if top1 else None,
    }


def shift_series(rows: list[dict[str, Any]]) -> tuple[list[int], list[float], dict[int, list]]:
    """Steps, the mean shift per step, and each layer's shift per step (0 where absent)."""
    steps = [int(r["step"]) for r in rows]
    mean = [float(r["mean_shift"]) for r in rows]
    layers: dict[int, list[float]] = {}
    for j, row in enumerate(rows):
        for entry in row["layers"]:
            layers.setdefault(int(entry["layer"]), [0.0] * len(rows))[j] = float(entry["shift"])
    return steps, mean, layers
