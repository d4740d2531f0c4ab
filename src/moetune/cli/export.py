"""`moetune export`: a trained adapter as a merged checkpoint, a vLLM adapter, a GGUF LoRA
(or mlx), then the served == trained check. Registered on moetune's one typer app."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from moetune.cli.common import JsonOpt, app, console, emit_json, friendly
from moetune.errors import ConfigError


@app.command("export")
@friendly
def export_cmd(
    source: Annotated[
        Path | None, typer.Argument(help="A run dir (output.dir) or a peft adapter dir.")
    ] = None,
    fmt: Annotated[str | None, typer.Option("--format", help="merged | vllm | gguf | mlx.")] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="New folder to write (refused if not empty).")
    ] = None,
    base: Annotated[
        str | None, typer.Option(help="Base model dir or id (default: the run's / adapter's).")
    ] = None,
    dtype: Annotated[
        str, typer.Option(help="auto (the base's own) | bfloat16 | float16 | float32.")
    ] = "auto",
    max_shard_size: Annotated[
        str, typer.Option(help="Largest safetensors shard (merged), e.g. 5GB or 500MB.")
    ] = "5GB",
    check: Annotated[
        bool,
        typer.Option("--check/--no-check", help="Run the consumer and compare with the adapter."),
    ] = True,
    check_only: Annotated[
        Path | None,
        typer.Option(help="Only check an existing export DIR (one marked UNCHECKED)."),
    ] = None,
    items: Annotated[
        Path | None,
        typer.Option(
            help='JSONL of {"prompt": …} rows (an answer beside it is ignored) or {"text": …} '
            "rows to check on (default: the run's eval items)."
        ),
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="Eval items the check uses.")] = 16,
    vllm_layout: Annotated[
        str, typer.Option(help="vllm: auto (what the family's wrapper reads) | fused (peft's).")
    ] = "auto",
    requantize: Annotated[
        bool,
        typer.Option(
            help="merged over a quantised base: write it back in the base's stored format "
            "(refused when too little of the LoRA effect survives the rounding)."
        ),
    ] = False,
    survival_floor: Annotated[
        float,
        typer.Option(help="--requantize: least share of ΔW that must survive, in (0, 1]."),
    ] = 0.5,
    trust_remote_code: Annotated[
        bool,
        typer.Option(help="Run the base's own modeling code (read it first; a run keeps its own)."),
    ] = False,
    unpromoted: Annotated[
        bool,
        typer.Option(
            "--unpromoted",
            help="Export an adapter that was evaluated and not promoted (the export and the "
            "report say so).",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Export an adapter for serving and check that what is served equals what was trained."""
    # lazy: the stage loads only when its command runs
    from moetune.export.check import CheckOptions
    from moetune.export.pipeline import check_only as run_check_only
    from moetune.export.pipeline import export
    from moetune.export.registry import export_options

    check_opts = CheckOptions(items=limit, items_file=items) if check else None
    if check_only is not None:
        doc = run_check_only(check_only, CheckOptions(items=limit, items_file=items))
    else:
        given = _required(source, fmt, out)
        extra = {"vllm_layout": vllm_layout, "survival_floor": _share(survival_floor)}
        opts = export_options(
            dtype=dtype, max_shard_size=max_shard_size, extra=extra | _requant(requantize, fmt)
        )
        doc = export(*given, opts, check_opts, base, trust_remote_code, unpromoted)
    if as_json:
        emit_json(doc)
    else:
        _print(doc)


def _share(floor: float) -> float:
    """A survival floor is a share in (0, 1]: NaN passed every comparison (nothing refused)
    and 0 let any rounding through, both without a word."""
    if not 0 < floor <= 1:
        raise ConfigError(
            f"--survival-floor {floor} is not a share in (0, 1]",
            "pass e.g. --survival-floor 0.5 (the least share of ΔW the rounding must keep)",
        )
    return floor


def _required(source: Path | None, fmt: str | None, out: Path | None) -> tuple[Path, str, Path]:
    if source is None or fmt is None or out is None:
        raise ConfigError(
            "export needs SOURCE, --format and --out",
            "e.g. moetune export RUN_DIR --format merged --out merged/ (or --check-only DIR)",
        )
    return source, fmt, out


def _requant(requantize: bool, fmt: str | None) -> dict[str, Any]:
    if requantize and fmt != "merged":
        raise ConfigError(
            f"--requantize re-quantises a merged checkpoint, not a {fmt} export",
            "use --format merged --requantize (or drop --requantize)",
        )
    return {"requantize": requantize}


def _print(doc: dict[str, Any]) -> None:
    console.print(f"[bold]{doc['format']}[/] → {escape(doc['out'])} ({len(doc['files'])} files)")
    for note in doc["notes"]:
        console.print(f"  note: {escape(note)}")
    survival = doc.get("details", {}).get("survival")
    if survival and survival["survival"] is not None:
        console.print(
            f"re-quantised ({survival['format']}): {survival['survival']:.1%} of the expert LoRA "
            f"effect survives (worst {escape(survival['worst_stack'])}: {survival['worst']:.1%})"
        )
    check = doc["check"]
    if "skipped" in check:
        console.print(f"check: skipped – {escape(check['skipped'])}")
        return
    console.print(
        f"check ({check['consumer']}): [bold green]served == trained[/] on {check['items']} "
        f"items · logits rel {check['logits_rel']:.2g} (tolerance {check['tolerance']:g}) · "
        f"expert LoRA effect {check['expert_effect']:.2g} · greedy equal "
        f"{check['greedy_match']:.0%} (medians over items; worst item "
        f"{check['logits_rel_max']:.2g})"
    )
