"""`moetune bench …`: research benches on the tiny builder (GM-1: MoE vs dense).
Registered on moetune's one typer app (imported at the end of cli.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from moetune.cli.common import JsonOpt, app, console, emit_json, err_console, friendly
from moetune.io import atomic_write_json

bench_app = typer.Typer(help="Research benches, trained from scratch on CPU.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _arm_names(arms: list[str] | None) -> tuple[str, ...] | None:
    if not arms:
        return None
    return tuple(a.strip() for item in arms for a in item.split(",") if a.strip())


def _out_dir(out: Path | None) -> Path:
    # lazy: the stage loads only when its command runs
    from moetune.bench.arms import BenchError

    out = out or Path(f"gm1-{datetime.now(UTC):%Y%m%d-%H%M%S}")
    if (out / "results.json").exists():
        raise BenchError(f"{out} already holds a GM-1 result", "pass a new --out directory")
    if out.exists() and not out.is_dir():
        raise BenchError(f"{out} is a file, not a directory", "pass a directory as --out")
    return out


def _progress(total: int, quiet: bool) -> Progress:
    return Progress(
        TextColumn("[bold]gm1[/] {task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        disable=quiet,
    )


def _ci(ce: dict[str, Any]) -> str:
    if ce["half_width"] is None:
        return f"{ce['mean']:.4f}"
    return f"{ce['mean']:.4f} ± {ce['half_width']:.4f}"


def _routing_cell(arm: dict[str, Any]) -> str:
    layers = arm.get("routing") or []
    if not layers:
        return "–"
    entropy = min(x["entropy_min"] for x in layers)
    top = max(x["max_fraction_max"] for x in layers)
    dead = max(max(x["dead_experts_per_seed"]) for x in layers)
    collapsed = sum(x["collapsed_seeds"] > 0 for x in layers)
    return f"H≥{entropy:.2f} max {top:.0%} dead≤{dead} collapsed {collapsed}/{len(layers)}"


def _print(summary: dict[str, Any]) -> None:
    table = Table("arm", "active", "total", "held-out CE (95% CI)", "gap vs dense", "tok/s",
                  "routing (worst layer)", title="GM-1", title_justify="left")  # fmt: skip
    for name, arm in summary["arms"].items():
        p, gap = arm["params"], arm.get("gap_vs_dense")
        paired = (gap or {}).get("paired_pct") or {}
        cell = "–" if not gap else f"{gap['of_means_pct']:+.2f} %"
        if paired.get("half_width") is not None:
            cell += f" (± {paired['half_width']:.2f})"
        table.add_row(name, f"{p['active_params']:,}", f"{p['total_params']:,}",
                      _ci(arm["heldout_ce"]), cell, f"{arm['tokens_per_s']:,.0f}",
                      _routing_cell(arm))  # fmt: skip
    console.print(table)
    # lazy: the stage loads only when its command runs
    from moetune.bench.summary import verdict

    for line in verdict(summary):
        console.print(escape(line))
    cfg = summary["config"]
    console.print(f"{cfg['tokens_per_run']:,} training tokens per run · {summary['wall_s']} s "
                  f"wall · files in {escape(str(summary['files']['dir']))}")  # fmt: skip


@bench_app.command("gm1")
@friendly
def gm1(
    size: Annotated[str, typer.Option(help="tiny | small (default, ~6 M) | medium | large.")] = (
        "small"
    ),
    seeds: Annotated[int, typer.Option(help="Seeds per arm (2+ for intervals).")] = 3,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps per run.")] = None,
    tokens: Annotated[int | None, typer.Option(help="Training tokens per run.")] = None,
    arms: Annotated[
        list[str] | None,
        typer.Option(
            help="Comma list of moe-top1, moe-top2, moe-matched-total, moe-top1-aux (+ dense)."
        ),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Results dir (default ./gm1-<time>).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """GM-1: dense vs top-1/top-2 MoE at matched active parameters, from scratch."""
    # lazy: the stage loads only when its command runs
    from moetune.bench.arms import DEFAULT_ARMS, get_arms
    from moetune.bench.gm1 import BenchConfig, run_bench
    from moetune.bench.summary import plot, summarize

    names = _arm_names(arms) or DEFAULT_ARMS
    config = BenchConfig(size=size, seeds=seeds, steps=steps, tokens=tokens, arms=names)
    runs = config.validated().seeds * len(get_arms(list(names)))
    total = config.resolved_steps() * runs
    target = _out_dir(out)
    with _progress(total, as_json) as bar:
        task = bar.add_task("", total=total)
        raw = run_bench(config, lambda a, s: bar.update(task, advance=1, description=f"{a} s{s}"))
    target.mkdir(parents=True, exist_ok=True)
    summary = summarize(raw)
    summary["files"] = {"dir": str(target), "results": str(target / "results.json"),
                        "plot": str(plot(summary, target / "loss_curves.png"))}  # fmt: skip
    atomic_write_json(target / "results.json", summary)
    if as_json:
        emit_json(summary)
    else:
        _print(summary)
