"""The report's figures, each returned as a PNG data URI ready for an <img src>.

Figures are built with `matplotlib.figure.Figure` and rendered by Agg, never through
pyplot: nothing is registered in pyplot's global figure list, so a report never leaks
figures or needs a display, and each figure is closed (its canvas dropped) once saved.
Sizes and dpi are fixed and modest so a report stays a few hundred kB.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from moetune.units import human_bytes

DPI = 100
MAX_HEATMAP_LAYERS = 8  # more layers make each heatmap too small to read
BASE_COLOR, CANDIDATE_COLOR = "#8c8c8c", "#1f77b4"


def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # Agg explicitly: headless, and independent of pyplot's backend
    return fig


def to_data_uri(fig: Figure) -> str:
    """The figure as a base64 PNG data URI; the figure is closed afterwards."""
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    finally:
        fig.clear()  # drop the artists; with no pyplot reference the figure is then freed
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def loss_plot(rows: Sequence[dict[str, Any]]) -> str:
    """Training loss per logged step (eval loss as points), learning rate on a second axis."""
    fig = new_figure(7, 3.2)
    ax = fig.add_subplot()
    train = [(r["step"], r["loss"]) for r in rows if isinstance(r.get("loss"), int | float)]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if train:
        ax.plot(*zip(*train, strict=True), color=CANDIDATE_COLOR, label="train loss")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o", color="#d62728", label="eval loss")
    lrs = [(r["step"], r["lr"]) for r in rows if isinstance(r.get("lr"), int | float)]
    if lrs:
        lr_ax = ax.twinx()
        lr_ax.plot(*zip(*lrs, strict=True), "--", color="#bbbbbb", linewidth=1)
        lr_ax.set_ylabel("learning rate", color="#888888")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    return to_data_uri(fig)


def shift_plot(
    steps: Sequence[int],
    mean: Sequence[float],
    layers: dict[int, Sequence[float]],
    warn_at: float | None,
) -> str:
    """Rollout → training routing shift per step: the mean over MoE layers (bold), the
    shown layers (thin), and the warning threshold (dashed)."""
    fig = new_figure(7, 3.0)
    ax = fig.add_subplot()
    for layer, shares in layers.items():
        ax.plot(steps, [100 * v for v in shares], linewidth=0.8, alpha=0.6, label=f"layer {layer}")
    ax.plot(steps, [100 * v for v in mean], color="black", linewidth=2, label="mean")
    if warn_at:
        ax.axhline(100 * warn_at, linestyle="--", color="#d62728", linewidth=1, label="warn")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("tokens routed differently (%)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return to_data_uri(fig)


def memory_plot(bars: Sequence[tuple[str, int]]) -> str:
    """Horizontal bars of planned vs measured bytes; log scale when they differ > 20x."""
    fig = new_figure(7, 0.5 + 0.45 * len(bars))
    ax = fig.add_subplot()
    labels = [label for label, _ in bars]
    values = [max(value, 1) for _, value in bars]
    colors = [BASE_COLOR if "planned" in label else CANDIDATE_COLOR for label in labels]
    ax.barh(labels, values, color=colors)
    ax.invert_yaxis()  # the first bar on top, as in the table
    if max(values) / min(values) > 20:
        ax.set_xscale("log")
    for y, value in enumerate(values):
        ax.text(value, y, f" {human_bytes(value)}", va="center", fontsize=8)
    ax.set_xlim(right=max(values) * (4 if ax.get_xscale() == "log" else 1.25))
    ax.set_xlabel("bytes")
    return to_data_uri(fig)


def pick_layers(layers: Sequence[int], cap: int = MAX_HEATMAP_LAYERS) -> list[int]:
    """At most `cap` layers, evenly spaced over `layers`, first and last included."""
    if len(layers) <= cap:
        return list(layers)
    step = (len(layers) - 1) / (cap - 1)
    return [layers[round(i * step)] for i in range(cap)]


def routing_plot(steps: Sequence[int], loads: dict[int, list[list[float]]]) -> str:
    """One heatmap per layer: experts (rows) x recorded steps (columns) of load fractions.
    `loads[layer][j]` holds the fractions per expert at `steps[j]`."""
    ncols = min(4, len(loads))
    nrows = math.ceil(len(loads) / ncols)
    fig = new_figure(min(12, 3.2 * ncols + 1), 2.6 * nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    vmax = max(max(max(col) for col in cols) for cols in loads.values()) or 1.0
    image = None
    for ax, (layer, cols) in zip(axes.flat, loads.items(), strict=False):
        matrix = [list(row) for row in zip(*cols, strict=True)]  # experts x steps
        image = ax.imshow(
            matrix, aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest"
        )
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xticks(_tick_positions(len(steps)))
        ax.set_xticklabels([str(steps[i]) for i in _tick_positions(len(steps))], fontsize=7)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("expert", fontsize=8)
    for ax in list(axes.flat)[len(loads) :]:
        ax.set_visible(False)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="load fraction")
    return to_data_uri(fig)


def _tick_positions(n: int, most: int = 6) -> list[int]:
    return (
        sorted({round(i * (n - 1) / (most - 1)) for i in range(most)})
        if n > most
        else list(range(n))
    )


def ladder_plot(rungs: Sequence[dict[str, Any]]) -> str:
    """Base vs candidate score per rung with ±stderr; one panel per unit, since accuracy
    and negative NLL do not share a scale."""
    units = sorted({str(r.get("unit", "score")) for r in rungs})
    fig = new_figure(min(12, 1.2 + 0.9 * len(rungs) + 1.5 * len(units)), 3.2)
    widths = [sum(str(r.get("unit", "score")) == unit for r in rungs) for unit in units]
    axes = fig.subplots(1, len(units), squeeze=False, width_ratios=widths)[0]
    for ax, unit in zip(axes, units, strict=True):
        group = [r for r in rungs if str(r.get("unit", "score")) == unit]
        xs = range(len(group))
        for offset, side, color in (
            (-0.2, "base", BASE_COLOR),
            (0.2, "candidate", CANDIDATE_COLOR),
        ):
            scores = [r[side]["score"] for r in group]
            errors = [r[side].get("stderr") or 0.0 for r in group]
            ax.bar(
                [x + offset for x in xs],
                scores,
                0.4,
                yerr=errors,
                color=color,
                label=side,
                capsize=3,
            )
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["name"] for r in group], rotation=20, ha="right", fontsize=8)
        ax.set_title(unit, fontsize=9)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    return to_data_uri(fig)
