"""Byte and count formatting shared by the CLI, reports and messages."""

from __future__ import annotations

GiB = 1024**3
GB = 1000**3


def gib(n: float | None) -> str:
    """Bytes as GiB with one decimal ("72.1 GiB"); '-' for None."""
    return "-" if n is None else f"{n / GiB:,.1f} GiB"


def count(n: int) -> str:
    """A parameter count in short form: 30.53 B, 642.5 M, 12.3 K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return str(n)
