"""`moetune data RUN.yaml`: what the run will train on, before it does – rows per source and
after mixing, token lengths against train.seq_len, the share of tokens with loss, rendered
samples with the loss mask in colour, train/eval duplicates, steps and step time."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from moetune.cli.common import JsonOpt, SetOpt, app, console, emit_json, friendly
from moetune.config import load_config

LOSS_STYLE, CONTEXT_STYLE = "bold green", "dim"


@app.command(name="data")
@friendly
def data_cmd(
    config: Annotated[Path, typer.Argument(help="The run.yaml whose data to preview.")],
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Preview a run's data: sources, mixing, lengths, loss share, masked samples, steps."""
    # lazy: the stage loads only when its command runs
    from moetune.train.preview import preview

    cfg = load_config(config, overrides or [])
    got = preview(cfg)
    if not as_json:
        _print(got)  # the samples show why, before the refusal below
    got.summary.refuse_no_loss()  # what `train` refuses, with its line
    if as_json:
        emit_json(got.to_json())


def _sources_table(summary: Any) -> Table:
    table = Table("source", "rows", "weight", title=f"{summary.format} rows")
    for s in summary.sources:
        table.add_row(s["source"], str(s["rows"]), f"{s['weight']:g}")
    table.add_row("[bold]after mixing[/]", f"[bold]{summary.rows}[/]", "")
    return table


def _histogram_table(summary: Any) -> Table:
    table = Table("tokens", "rows", "", title=f"token lengths (train.seq_len {summary.seq_len})")
    top = max((h["rows"] for h in summary.histogram), default=1) or 1
    low = 0
    for h in summary.histogram:
        span = f"{low + 1}-{h['upto']}" if h["upto"] else f"> {summary.seq_len}"
        table.add_row(span, str(h["rows"]), "█" * round(24 * h["rows"] / top))
        low = h["upto"] or low
    return table


def _sample(runs: list[Any]) -> Text:
    text = Text()
    for chunk, loss in runs:
        text.append(chunk, style=LOSS_STYLE if loss else CONTEXT_STYLE)
    return text


def _print(got: Any) -> None:
    s = got.summary
    console.print(_sources_table(s))
    console.print(_histogram_table(s))
    console.print(
        f"{s.truncated} rows over seq_len (truncated), {s.no_loss_left} left with no loss "
        f"token · {s.loss_share:.1%} of tokens carry loss · {s.eval_rows} eval rows, "
        f"{s.duplicates} also in train"
    )
    steps = f"~{s.steps} optimizer steps" if s.steps else "steps: unknown"
    step_s = f" · ~{got.step_s:.3g} s/step on {got.card} (analytic)" if got.step_s else ""
    console.print(steps + step_s)
    if s.images:  # image+text rows: the processor adds each image's tokens to the lengths
        per_row = ", ".join(f"{n} per row: {rows}" for n, rows in s.images["per_row"].items())
        console.print(
            f"images: {s.images['images']} in {s.images['rows_with_images']} of {s.rows} rows "
            f"(rows with {per_row}); lengths count text tokens only"
        )
    if s.streaming_rows_checked:
        console.print(f"data.streaming: figures from the first {s.streaming_rows_checked} rows")
    for n, runs in enumerate(s.samples, 1):
        console.print(Text(f"sample {n} (loss in green):", style="bold"))
        console.print(_sample(runs))
