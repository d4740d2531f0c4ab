"""Rich renderings of the offload plan (`moetune plan --offload cpu|disk`)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from moetune.config.keys import offload_mode
from moetune.units import gib

GiB = 1024**3


def offload_components_table(plans: dict[str, Any]) -> Table:
    """The device peak by component of the first plan (only `overhead` differs per card)."""
    key, plan = next(iter(plans.items()))
    where = "this host's RAM (CPU device)" if plan.card == "cpu" else key
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
    """One column per card (rows: device fit, host RAM and disk, bytes moved, link, step
    time), so several cards still read at 80 columns."""
    table = Table(title="offload per card, one optimizer step", title_justify="left")
    table.add_column("")
    for key in plans:
        table.add_column(key, justify="right")
    for label, cell in _CARD_ROWS:
        table.add_row(label, *(cell(p) for p in plans.values()))
    return table


def _fits(p: Any) -> str:
    return "-" if p.fits is None else ("[green]yes[/]" if p.fits else "[red]no[/]")


def _ram(p: Any) -> str:
    ram = f"{p.host_ram_bytes / GiB:,.0f} / {p.host_ram_available_bytes / GiB:,.0f} GiB"
    return ram if p.host_ram_fits else f"[red]{ram}[/]"


def _moved(p: Any) -> str:
    moved = p.bytes_moved_per_step
    return "/".join(f"{moved[k] / GiB:,.0f}" for k in ("forward", "recompute", "backward")) + " GiB"


def _link(p: Any) -> str:
    disk = "disk → " if offload_mode(p.offload).on_disk else ""
    return f"{disk}{p.host_link.name}, {p.transfer_bytes_per_s / 1e9:.3g} GB/s"


def _tokens_per_s(p: Any) -> str:
    rate = p.tokens_per_s
    return f"{rate:,.0f}" if rate >= 10 else f"{rate:.2g}"


_CARD_ROWS: tuple[tuple[str, Any], ...] = (
    ("device peak", lambda p: gib(p.device_peak_bytes)),
    ("usable", lambda p: gib(p.usable_bytes)),
    ("fits", _fits),
    ("pinned host RAM", lambda p: gib(p.pinned_host_bytes)),
    ("host RAM need / has", _ram),
    ("disk", lambda p: gib(p.disk_bytes)),
    ("moved fwd/recompute/bwd", _moved),
    ("host link", _link),
    ("step time", lambda p: f"{p.step_time_s:.2f} s ({p.bound})"),
    ("balance tokens", lambda p: f"{p.balance_tokens:,}"),
    ("tokens/s", _tokens_per_s),
)
