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


def human_bytes(n: float) -> str:
    """Bytes in the largest binary unit below 1024 ("512 B", "3.4 MiB", "1.2 TiB")."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
