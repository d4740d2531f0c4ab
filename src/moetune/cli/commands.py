"""The pipeline's commands: inspect, plan, lint, recipe, train, schema, quickstart,
eval, gate, report (doctor: cli.doctor) – each calls one entry function."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.markup import escape
from rich.table import Table

from moetune.cli.common import (
    JsonOpt,
    SetOpt,
    app,
    console,
    emit_json,
    err_console,
    friendly,
)
from moetune.cli.options import checked, opt, option_overrides
from moetune.cli.render import (
    device_components_table,
    device_fits_table,
    examples_table,
    fits_table,
    ladder_table,
    plan_components_table,
    print_findings,
    print_plan_notes,
    print_recommendations,
    quickstart_table,
    spec_summary,
    spec_table,
    verdict_table,
)
from moetune.cli.render_offload import offload_cards_table, offload_components_table
from moetune.config import load_config, schema_rows
from moetune.config.keys import offload_mode
from moetune.config.reference import reference_markdown
from moetune.errors import ConfigError
from moetune.units import human_bytes


@app.command()
@friendly
def inspect(
    model: Annotated[str, typer.Argument(help="Local dir/config.json, catalog id or hub id.")],
    trust_remote_code: Annotated[bool, opt("trust_remote_code")] = False,
    as_json: JsonOpt = False,
) -> None:
    """What a model is: MoE layout and exact parameters by component."""
    # lazy: the stage loads only when its command runs
    from moetune.model import load_spec
    from moetune.plan.stored import refuse_unreadable

    spec = load_spec(model, trust_remote_code)
    refuse_unreadable(spec)  # as plan, lint and train do: never a spec of an unreadable base
    if as_json:
        emit_json(spec.to_json())
        return
    console.print(spec_table(spec))
    console.print(spec_summary(spec))


@app.command()
@friendly
def plan(
    target: Annotated[str, typer.Argument(help="Model (dir, catalog id, hub id) or a run.yaml.")],
    card: Annotated[
        list[str] | None, typer.Option("--card", help="Card id (repeatable; default: all).")
    ] = None,
    tuning: Annotated[str | None, opt("tuning")] = None,
    method: Annotated[str | None, opt("method")] = None,
    rank: Annotated[int | None, opt("rank")] = None,
    seq: Annotated[int | None, opt("seq")] = None,
    batch: Annotated[int | None, opt("batch")] = None,
    targets: Annotated[str | None, opt("targets")] = None,
    no_gc: Annotated[bool, opt("no_gc")] = False,
    mapping: Annotated[str | None, opt("mapping")] = None,
    estimator: Annotated[
        Literal["trace", "analytic"],
        typer.Option(help="trace (reference) | analytic (instant)."),
    ] = "analytic",
    engine: Annotated[str | None, opt("engine")] = None,
    experts_dtype: Annotated[str | None, opt("experts_dtype")] = None,
    gpus: Annotated[
        int | None, opt("gpus", "Plan each of N data-parallel GPUs (per device).", like=True)
    ] = None,
    strategy: Annotated[
        str | None, opt("strategy", "With --gpus (default fsdp).", like=True)
    ] = None,
    nodes: Annotated[int | None, opt("nodes", "Nodes of --gpus GPUs each.", like=True)] = None,
    offload: Annotated[str | None, opt("offload", "Plan frozen experts streamed from.")] = None,
    host_ram: Annotated[float | None, opt("host_ram")] = None,
    trust_remote_code: Annotated[bool, opt("trust_remote_code")] = False,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Peak memory by component, fit per card, and per card the best config that fits."""
    # lazy: the stage loads only when its command runs
    from moetune.lane.providers import site_of
    from moetune.lint.preflight import lint_context, resolve_run
    from moetune.lint.registry import lint
    from moetune.model import load_spec
    from moetune.plan import make_plan

    opts = option_overrides(
        tuning=tuning, method=method, rank=rank, seq=seq, batch=batch, targets=targets,
        no_gc=no_gc, mapping=mapping, engine=engine, experts_dtype=experts_dtype,
        offload=offload, host_ram=host_ram, trust_remote_code=trust_remote_code,
    )  # fmt: skip
    gpus, strategy = checked("gpus", gpus), checked("strategy", strategy)
    nodes = checked("nodes", nodes)
    cfg = resolve_run(target, [*(overrides or []), *opts])
    spec = load_spec(cfg.model.id, cfg.model.trust_remote_code)
    planned = _planned_cards(card, cfg)
    result = make_plan(spec, cfg, cards=planned, estimator=estimator)
    findings = lint(lint_context(cfg, spec, result, site_of(cfg.lane.provider)))
    devices = _devices(spec, cfg, list(result.fits), gpus, strategy, nodes)
    offloads = _offloads(spec, _ep_ranks(cfg, gpus, strategy, nodes),
                         card or ([cfg.hardware.card] if cfg.hardware.card else None))  # fmt: skip
    named = planned[0] if planned and not card else None  # hardware.card or this GPU
    why = "hardware.card" if cfg.hardware.card else "this machine's GPU"
    if as_json:
        extra = {"devices": devices.to_json()} if devices else {}
        extra |= {"card": named}
        extra |= {"offload": {k: p.to_json() for k, p in offloads.items()}} if offloads else {}
        emit_json({**result.to_json(), "findings": [f.rule_id for f in findings], **extra})
        return
    if named:
        console.print(f"card: {named} ({why}; the catalog's cards follow)")
    console.print(f"assumed: {escape(result.assumed)}", highlight=False, soft_wrap=True)
    console.print(plan_components_table(result))
    print_plan_notes(console, result)
    console.print(fits_table(result))
    print_recommendations(console, result)
    print_findings(console, findings)
    if devices:
        console.print(device_components_table(devices))
        console.print(device_fits_table(devices))
        for note in devices.notes:
            console.print(f"[dim]note:[/] {escape(note)}")
    if offloads:
        console.print(offload_components_table(offloads))
        console.print(offload_cards_table(offloads))
        for note in next(iter(offloads.values())).notes:
            console.print(f"[dim]note:[/] {escape(note)}")


def _planned_cards(cards: list[str] | None, cfg: Any) -> list[str] | None:
    """--card, else hardware.card (or this machine's GPU) first and the rest of the catalog
    after it, else None (the catalog)."""
    # lazy: the stage loads only when its command runs
    from moetune.plan.hardware import card_ids, get_card, local_card_ids

    if cards:
        return cards
    first = [cfg.hardware.card] if cfg.hardware.card else local_card_ids()[:1]
    if not first:
        return None
    card = get_card(first[0])
    if card.is_host:  # this host plans alone, as train runs there (as --card cpu does)
        return [card.id]
    return [card.id, *(c for c in card_ids() if c != card.id)]


def _offloads(spec: Any, cfg: Any, cards: list[str] | None) -> dict[str, Any]:
    """The offload plan per card when train.offload is cpu or disk (--offload or the YAML):
    the --card cards, else the catalog's, else (no CUDA here) this host's "cpu" card; per
    rank under train.strategy ep on several ranks (a store a rank)."""
    if not offload_mode(cfg.train.offload).streams:
        return {}
    # lazy: the stage loads only when its command runs
    from moetune.plan.devices.ep_offload import offload_plans_of_run

    return offload_plans_of_run(spec, cfg, cards)


def _ep_ranks(cfg: Any, gpus: int | None, strategy: str | None, nodes: int | None) -> Any:
    """`--gpus N --strategy ep [--nodes M]`: the run on those ranks (offload plans per rank)."""
    if not gpus or strategy != "ep":
        return cfg
    train = cfg.train.model_copy(update={"nproc": gpus, "nnodes": nodes or 1, "strategy": "ep"})
    return cfg.model_copy(update={"train": train})


def _devices(
    spec: Any, cfg: Any, cards: list[str], gpus: int | None, strategy: str | None,
    nodes: int | None,
) -> Any:  # fmt: skip
    """The per-device report when --gpus, --strategy or --nodes is given (defaults 1 GPU
    per node, fsdp, train.nnodes nodes)."""
    if gpus is None and strategy is None and nodes is None:
        return None
    # lazy: the stage loads only when its command runs
    from moetune.plan.devices.sharding import device_report

    per_node = 1 if gpus is None else gpus
    count = cfg.train.nnodes if nodes is None else nodes
    return device_report(spec, cfg, cards, per_node, strategy or "fsdp", count)


@app.command(name="lint")
@friendly
def lint_cmd(
    target: Annotated[str, typer.Argument(help="A run.yaml (or a model id with defaults).")],
    trust_remote_code: Annotated[bool, opt("trust_remote_code")] = False,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Every known trap in a run config, with what happens and the fix. Exit 1 on errors."""
    # lazy: the stage loads only when its command runs
    from moetune.lane.providers import site_of
    from moetune.lint.preflight import lint_run, resolve_run

    opts = option_overrides(trust_remote_code=trust_remote_code)
    cfg = resolve_run(target, [*(overrides or []), *opts])
    findings, _ = lint_run(cfg, site=site_of(cfg.lane.provider))
    if as_json:
        emit_json({"findings": [f.to_json() for f in findings]})
    else:
        print_findings(console, findings)
    if any(f.severity == "error" for f in findings):
        raise typer.Exit(1)


@app.command()
@friendly
def recipe(
    model: Annotated[str, typer.Argument(help="Model (dir, catalog id, hub id) or a run.yaml.")],
    stack: Annotated[str | None, opt("stack")] = None,
    rank: Annotated[int | None, opt("rank")] = None,
    targets: Annotated[str | None, opt("targets")] = None,
    trust_remote_code: Annotated[bool, opt("trust_remote_code")] = False,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The exact LoRA configuration that reaches the experts, audited on a built model."""
    # lazy: the stage loads only when its command runs
    from moetune.lint.preflight import resolve_run
    from moetune.model import load_spec
    from moetune.recipe import recipe_for, render_recipe

    opts = option_overrides(
        stack=stack, rank=rank, targets=targets, trust_remote_code=trust_remote_code
    )
    cfg = resolve_run(model, [*(overrides or []), *opts])
    result = recipe_for(load_spec(cfg.model.id, cfg.model.trust_remote_code), cfg.lora, cfg)
    if as_json:
        emit_json(result)
    else:
        render_recipe(console, result)


@app.command(name="train")
@friendly
def train_cmd(
    config: Annotated[Path, typer.Argument(help="The run.yaml to train.")],
    overrides: SetOpt = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue output.dir from its last checkpoint.")
    ] = False,
    allow_errors: Annotated[
        bool, typer.Option("--allow-errors", help="Train despite preflight errors (recorded).")
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite", help="Replace moetune's files of a finished run in output.dir."
        ),
    ] = False,
    overwrite_promoted: Annotated[
        bool,
        typer.Option(
            "--overwrite-promoted",
            help="Like --overwrite, and also replace an adapter the gate promoted.",
        ),
    ] = False,
    engine: Annotated[str | None, opt("engine")] = None,
    nproc: Annotated[int | None, opt("nproc")] = None,
    strategy: Annotated[str | None, opt("strategy", "With --nproc: how they split the work.")] = (
        None
    ),
    nnodes: Annotated[int | None, opt("nnodes")] = None,
    node_rank: Annotated[int | None, opt("node_rank")] = None,
    master_addr: Annotated[str | None, opt("master_addr")] = None,
    master_port: Annotated[int | None, opt("master_port")] = None,
    rdzv_timeout: Annotated[int | None, opt("rdzv_timeout")] = None,
    report_to: Annotated[str | None, opt("report_to")] = None,
    trust_remote_code: Annotated[bool, opt("trust_remote_code")] = False,
    as_json: JsonOpt = False,
) -> None:
    """LoRA SFT that provably reaches the experts: preflight, train, audited adapter."""
    launch = {"nproc": nproc, "strategy": strategy, "nnodes": nnodes, "node_rank": node_rank}
    launch |= {"master_addr": master_addr, "master_port": master_port}
    launch |= {"rdzv_timeout": rdzv_timeout}
    launch |= {"trust_remote_code": trust_remote_code}
    sets = [*(overrides or []), *option_overrides(engine=engine, report_to=report_to, **launch)]
    cfg = load_config(config, sets)
    flags = {"resume": resume, "allow_errors": allow_errors, "overwrite": overwrite}
    flags |= {"overwrite_promoted": overwrite_promoted, "json": as_json}
    # stdout is the report: DeepSpeed's logger (imported with transformers) writes to stdout
    with contextlib.redirect_stdout(sys.stderr):
        # lazy: the stage loads only when its command runs
        from moetune.train import train
        from moetune.train.launch import launch_or_train, quiet_rank

        result = launch_or_train(cfg, config, sets, flags, train)
    if quiet_rank():  # a rank of a launch: the launcher or the main process reports
        return
    _report_train(result, as_json)


def _report_train(result: Any, as_json: bool) -> None:
    # lazy: the stage loads only when its command runs
    from moetune.train.distributed.nodes import NodeDone

    if as_json:
        emit_json(result.to_json())
        return
    if isinstance(result, NodeDone):  # node K > 0: node 0 has the results
        console.print(result.line())
        return
    if result.already_complete:  # --resume of a finished run: nothing trained, exit 0
        console.print(
            f"already complete: {escape(result.run_dir)} finished at step {result.steps}; "
            "nothing trained, no ledger row added (a new run: --overwrite or a new output.dir)"
        )
    loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "–"
    router = "changed" if result.router_changed else "unchanged"
    planned = human_bytes(result.planned_peak_bytes) if result.planned_peak_bytes else "–"
    by = f" ({result.planned_by})" if result.planned_by else ""
    console.print(f"adapter: {escape(result.adapter_dir)}")
    console.print(
        f"{result.steps} steps · final loss {loss} · LoRA coverage {result.coverage:.0%} · "
        f"router {router} · aux loss {'on' if result.aux_loss else 'off'} · {result.seconds:.1f} s"
    )
    console.print(
        f"peak memory {human_bytes(result.peak_memory_bytes)} measured, {planned} planned{by}"
    )
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}")


@app.command()
@friendly
def schema(
    as_json: JsonOpt = False,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Print the config reference page (docs/config.md).")
    ] = False,
) -> None:
    """Every run.yaml field with its default and meaning."""
    if markdown:
        sys.stdout.write(reference_markdown())
        return
    rows = schema_rows()
    if as_json:
        emit_json([{"field": f, "default": d, "description": t} for f, d, t in rows])
        return
    table = Table("field", "default", "meaning", title="run.yaml", title_justify="left")
    for row in rows:
        table.add_row(*row)
    console.print(table)


@app.command()
@friendly
def quickstart(
    out: Annotated[Path | None, typer.Option(help="Output dir (default: runs/qs-<time>).")] = None,
    steps: Annotated[int | None, typer.Option(help="Fine-tune optimizer steps.")] = None,
    method: Annotated[str, opt("method")] = "sft",
    stack: Annotated[str, opt("stack")] = "peft",
    seed: Annotated[int | None, opt("seed")] = None,
    as_json: JsonOpt = False,
) -> None:
    """The whole local pipeline on the embedded tiny MoE: train, eval, gate, promote, report."""
    # lazy: the stage loads only when its command runs
    from moetune.demo.quickstart import demo_args, run_quickstart

    if steps is not None and steps < 1:
        raise ConfigError(f"--steps {steps} is not a positive number", "pass --steps N >= 1")
    method, stack = checked("method", method), checked("stack", stack)
    given = {"out_dir": out, "steps": steps, "seed": checked("seed", seed)}
    args = demo_args(method, stack=stack, **{k: v for k, v in given.items() if v is not None})
    summary = run_quickstart(args, progress=not as_json)
    if as_json:
        emit_json(summary)
    else:
        console.print(quickstart_table(summary))


# ---------------------------------------------------------------- evaluate, gate, report


def _print_verdict(doc: dict[str, Any], results: Path) -> None:
    # lazy: the stage loads only when its command runs
    from moetune.evaluate.gate import read_json

    console.print(ladder_table(read_json(results / "ladder.json")))
    console.print(verdict_table(doc))
    if shown := examples_table(doc):
        console.print(shown)
    console.print(f"results: {escape(str(results))}")
    if doc.get("fix"):  # a verdict short of GO says what to do next (exit 1 follows)
        err_console.print(f"fix: {escape(doc['fix'])}", soft_wrap=True)


@app.command(name="eval")
@friendly
def eval_cmd(
    config: Annotated[Path, typer.Argument(help="The run.yaml whose eval.rungs to score.")],
    adapter: Annotated[
        Path | None, typer.Option(help="Adapter dir (default: <output.dir>/adapter).")
    ] = None,
    limit: Annotated[int | None, typer.Option(help="Only the first N items per rung.")] = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace moetune's earlier results in the results dir."),
    ] = False,
    provider: Annotated[
        str, opt("provider", "Only one that runs here (remote evals run in `moetune launch`).")
    ] = "local",
    gate_exit: Annotated[
        bool,
        typer.Option(
            "--gate-exit/--no-gate-exit",
            help="Exit 1 unless GO, as `gate` does (--no-gate-exit: 0 whenever the eval ran, "
            "for a caller that gates the results itself, as `moetune launch` does).",
        ),
    ] = True,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Score base and candidate on the same items of every rung, then gate; exit 1 unless GO."""
    # lazy: the stage loads only when its command runs
    from moetune.evaluate import run_eval
    from moetune.lane.providers import provider_class

    if provider_class(checked("provider", provider)).remote:
        raise ConfigError(
            f"eval runs here, not on {provider!r} (its pods are remote)",
            "to evaluate on a pod, `moetune launch run.yaml --provider …` runs eval there",
        )
    cfg = load_config(config, overrides)
    doc = run_eval(cfg, adapter, limit=limit, overwrite=overwrite, progress=not as_json)
    if as_json:
        emit_json(doc)
    else:
        _print_verdict(doc, cfg.eval.results_path(cfg.output.dir))
    if gate_exit and doc["verdict"] != "GO":  # as `gate`: `eval && export` stops at a NO-GO
        raise typer.Exit(1)


@app.command()
@friendly
def gate(
    results: Annotated[Path, typer.Argument(help="A results dir written by `moetune eval`.")],
    promote: Annotated[
        bool, typer.Option("--promote", help="On GO, mark the adapter promoted.")
    ] = False,
    alpha: Annotated[
        float | None, typer.Option(help="Family-wise error rate (default: the ladder's).")
    ] = None,
    ledger: Annotated[Path | None, typer.Option(help="Ledger file (default: the run's).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """GO / NO-GO / INCONCLUSIVE from paired differences; exit 1 unless GO."""
    # lazy: the stage loads only when its command runs
    from moetune.evaluate import gate_results
    from moetune.evaluate import promote as promote_adapter

    doc = gate_results(results, alpha, ledger)
    marker = promote_adapter(results, ledger) if promote and doc["verdict"] == "GO" else None
    if as_json:
        emit_json({**doc, "promoted": str(marker) if marker else None})
    else:
        _print_verdict(doc, results)
        if marker:
            console.print(f"[green]promoted:[/] {escape(str(marker))}")
    if promote and marker is None:
        err_console.print(f"[bold red]not promoted:[/] the verdict is {doc['verdict']}")
    if doc["verdict"] != "GO":
        raise typer.Exit(1)


@app.command()
@friendly
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run dir (output.dir of a run).")],
    out: Annotated[
        Path | None, typer.Option(help="HTML file (default RUN_DIR/report.html).")
    ] = None,
    results: Annotated[
        Path | None, typer.Option(help="Eval results dir (default RUN_DIR/eval).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """One self-contained HTML report: config, memory, loss, expert load, ladder, verdict."""
    # lazy: the stage loads only when its command runs
    from moetune.report import build_report

    path = build_report(run_dir, out, results)
    if as_json:
        emit_json({"report": str(path)})
    else:
        console.print(f"report: {escape(str(path))}")
