"""Rich tables for the per-device planner (`moetune plan --gpus`) and `moetune serve-plan`;
`--json` bypasses all of this."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from moetune.units import gib


def device_components_table(report: Any) -> Table:
    """One rank's peak by component."""
    title = f"per-device peak on {report.gpus} GPU(s), {report.strategy} (analytic)"
    table = Table(title=title, title_justify="left")
    table.add_column("component")
    table.add_column("bytes per device", justify="right")
    for name, n in report.components.items():
        table.add_row(name, gib(n))
    table.add_row(
        "[bold]live tensors per device[/]", f"[bold]{gib(sum(report.components.values()))}[/]"
    )
    return table


def device_fits_table(report: Any) -> Table:
    """Per card: the rank's required bytes on N GPUs, its fit, and the fewest GPUs that fit."""
    table = Table(title=f"fit per card on {report.gpus} GPU(s)", title_justify="left")
    for col in ("card", "usable", "required", "headroom", "fits", "fewest GPUs"):
        table.add_column(col, justify="left" if col == "card" else "right")
    for card_id, plan in report.plans.items():
        fit = plan.fit
        mark = "[green]yes[/]" if fit.fits else "[red]no[/]"
        fewest = report.fewest[card_id]
        table.add_row(
            card_id, gib(fit.usable_bytes), gib(fit.required_bytes), gib(fit.headroom_bytes),
            mark, "[red]none ≤ 64[/]" if fewest is None else str(fewest),
        )  # fmt: skip
    return table
