"""One self-contained HTML report per run: config, memory plan vs measured, loss curve,
expert-load heatmaps, the eval ladder and the gate's verdict.

    from moetune.report import build_report

    path = build_report(Path("runs/latest"))  # -> runs/latest/report.html

`html` gathers the run dir's files into sections (a missing input makes its section say
"not available", never fail) and renders the jinja template; `plots` draws the figures
as embedded PNGs, so the file opens anywhere without loading anything.
"""

from __future__ import annotations

from moetune.report.html import build_report
from moetune.report.out import ReportError

__all__ = ["ReportError", "build_report"]
