"""Rich renderings of the offload plan (`moetune plan --offload cpu|disk`)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from moetune.units import gib

GiB = 1024**3


def offload_components_table(plans: dict[str, Any]) -> Table:
    """The device peak by component of the first plan (only `overhead` differs per card)."""
    key, plan = next(iter(plans.items()))
    where = "host RAM (CPU device)" if plan.card is None else key
    title = f"offload {plan.offload}: device peak by component on {where}"
    table = Table(title=title, title_justify="left")
    table.add_column("component")
    table.add_column("bytes", justify="right")
    for name, n in plan.device_components.items():
        if n:
            table.add_row(name, gib(n))
    table.add_row("[bold]device peak[/]", f"[bold]{gib(plan.device_peak_bytes)}[/]")
    return table


def offload_cards_table(plans: dict[str, Any]) -> Table:
    """Per card: device fit, host RAM and disk, bytes moved, link and step time (t: bound
    by the transfer, c: by the compute)."""
    title = "offload per card, one optimizer step (moved: forward/recompute/backward; t/c: bound)"
    table = Table(title=title, title_justify="left")
    columns = ("card", "peak", "usable", "fits", "pinned", "host need/has", "disk",
               "moved f/r/b", "link", "step s", "balance tok", "tok/s")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col in ("card", "link") else "right")
    for key, p in plans.items():
        moved = p.bytes_moved_per_step
        fits = "-" if p.fits is None else ("[green]yes[/]" if p.fits else "[red]no[/]")
        ram = f"{p.host_ram_bytes / GiB:,.0f}/{p.host_ram_available_bytes / GiB:,.0f} GiB"
        table.add_row(
            key, gib(p.device_peak_bytes), gib(p.usable_bytes), fits,
            gib(p.pinned_host_bytes), ram if p.host_ram_fits else f"[red]{ram}[/]",
            gib(p.disk_bytes),
            "/".join(f"{moved[k] / GiB:,.0f}" for k in ("forward", "recompute", "backward"))
            + " GiB",
            f"{'disk → ' if p.offload == 'disk' else ''}{p.host_link.name}, "
            f"{p.transfer_bytes_per_s / 1e9:g} GB/s",
            f"{p.step_time_s:.2f} {p.bound[0]}", f"{p.balance_tokens:,}", f"{p.tokens_per_s:,.0f}",
        )  # fmt: skip
    return table
