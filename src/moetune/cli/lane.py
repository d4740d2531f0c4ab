"""The remote lane's commands: launch, pods list|reap|sweep, workflow github.
Registered on moetune's one typer app (imported at the end of cli.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from moetune.cli.common import JsonOpt, SetOpt, app, console, emit_json, err_console, friendly
from moetune.cli.options import checked, opt, option_overrides
from moetune.config import RunConfig, load_config
from moetune.errors import clip
from moetune.io import atomic_write_text, output_problem
from moetune.ledger import Ledger

ProviderOpt = Annotated[str | None, opt("provider", "Where to run (default: lane.provider).")]


NnodesOpt = Annotated[int | None, opt("nnodes", "Nodes to train on, node 0 the master.")]
HostsOpt = Annotated[str | None, opt("hosts", "Provider ssh: the nodes' hosts, node 0 first.")]


def _config(config: Path, provider: str | None, overrides: list[str] | None, **nodes: Any) -> Any:
    extra = option_overrides(provider=provider, **nodes)
    return load_config(config, [*(overrides or []), *extra])


def _print_plan(doc: dict[str, Any]) -> None:
    walls, est = doc["walls"], doc["estimate"]
    hours = lambda s: "?" if s is None else f"{s / 3600:.2f} h"  # noqa: E731
    console.print(f"[bold]launch plan[/] {escape(doc['run_id'])} on {doc['provider']}, "
                  f"card {doc['card'] or '(this machine)'}")  # fmt: skip
    table = Table("wall", "value", "why", title="walls (applied together)", title_justify="left")
    table.add_row("volume", f"{walls['volume_gb']} GB", escape(walls["why"]["volume_gb"]))
    table.add_row("watchdog", hours(walls["watchdog_s"]), escape(walls["why"]["watchdog_s"]))
    env = ", ".join(f"{k}={v}" for k, v in walls["env"].items())
    table.add_row("env", escape(env), escape(walls["why"]["env"]))
    console.print(table)
    console.print(f"phases: {' → '.join(doc['phases'])}")
    console.print(_card_line(doc["card_choice"]))
    _print_nodes(doc["nodes"])
    usd = "?" if doc["estimated_usd"] is None else f"${doc['estimated_usd']:.2f}"
    console.print(
        f"estimate: train {hours(est['estimated_train_s'])} ({escape(est['basis'])}) + eval "
        f"{hours(est['estimated_eval_s'])} + setup {hours(est['setup_s'])} · {usd}"
    )


def _print_nodes(nodes: list[dict[str, Any]]) -> None:
    """Each node's train command (one node: the only one, no table)."""
    if len(nodes) == 1:
        return
    table = Table("node", "host", "pod", "command", title=f"{len(nodes)} nodes (node 0 the "
                  "master; the estimate counts every node)", title_justify="left")  # fmt: skip
    for n in nodes:
        table.add_row(str(n["rank"]), escape(n["host"]), escape(n["pod"]), escape(n["command"]))
    console.print(table)


def _card_line(choice: dict[str, Any]) -> str:
    margin = f"{choice['min_headroom_fraction']:.0%}"
    return (
        f"card: {choice['card'] or '–'} ({escape(choice['why'])}) · with the {margin} margin: "
        f"{choice['with_margin'] or 'none'} · without it: {choice['without_margin'] or 'none'}"
    )


@app.command()
@friendly
def launch(
    config: Annotated[Path, typer.Argument(help="The run.yaml to run remotely.")],
    provider: ProviderOpt = None,
    nnodes: NnodesOpt = None,
    hosts: HostsOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan; run nothing.")
    ] = False,
    resume: Annotated[
        str | None, typer.Option("--resume", help="Continue the launch with this run id.")
    ] = None,
    accept_thin_margin: Annotated[
        bool,
        typer.Option(
            "--accept-thin-margin",
            help="Take the cheapest card that fits even with < 8 % headroom (ledgered).",
        ),
    ] = False,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Train, bank, eval, gate and promote on a pod (or --nnodes pods) – walls sized first,
    teardown always."""
    # lazy: the stage loads only when its command runs
    from moetune.lane.launch import launch as run_launch
    from moetune.lane.launch import launch_plan

    cfg = _config(config, provider, overrides, nnodes=nnodes, hosts=hosts)
    if dry_run:
        doc = launch_plan(cfg, accept_thin_margin=accept_thin_margin).to_json()
        emit_json(doc) if as_json else _print_plan(doc)
        return
    state = run_launch(
        cfg, config, resume=resume, show=not as_json, accept_thin_margin=accept_thin_margin
    )
    if as_json:
        emit_json(state.__dict__)
        return
    adapter = (state.banked or {}).get("dir", "–")
    console.print(
        f"run {escape(state.run_id)}: verdict {state.verdict or '–'} · adapter "
        f"{escape(adapter)} · promoted {'yes' if state.promoted else 'no'} · "
        f"spent ${state.spent_usd:.2f}"
    )


# ---------------------------------------------------------------- pods

pods_app = typer.Typer(help="Pods: list them, reap one by id, sweep moetune's orphans.")
app.add_typer(pods_app, name="pods")
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="run.yaml with the lane settings to use.")
]


def _pods_context(config: Path | None, provider: str | None) -> tuple[Any, Any]:
    """The provider and the ledger, from a run config (or the defaults)."""
    # lazy: the stage loads only when its command runs
    from moetune.lane.launch import make_provider

    cfg = _config(config, provider, None) if config else RunConfig()
    if provider and not config:
        cfg.lane.provider = checked("provider", provider)
    state_dir = Path(cfg.output.ledger).parent / "lane" / "_pods"
    return make_provider(cfg, state_dir), Ledger(cfg.output.ledger)


def _own_ids(ledger: Any) -> set[str]:
    """Pods moetune recorded by id: in the ledger, or in a launch's state (saved first)."""
    # lazy: the stage loads only when its command runs
    from moetune.lane.guard import own_pod_ids, state_pod_ids

    return own_pod_ids(ledger.read().rows) | state_pod_ids(Path(ledger.path).parent / "lane")


@pods_app.command("list")
@friendly
def pods_list(
    config: ConfigOpt = None, provider: ProviderOpt = None, as_json: JsonOpt = False
) -> None:
    """Every pod: status, uptime, GPU use, $/h, spent so far, and whether moetune made it."""
    prov, ledger = _pods_context(config, provider)
    own = _own_ids(ledger)
    pods = [{**p.to_json(), "moetune": p.id in own} for p in prov.list()]
    if as_json:
        emit_json(pods)
        return
    table = Table("id", "name", "status", "uptime", "GPU %", "$/h", "spent $", "moetune")
    for p in pods:
        gpu = "-" if p["gpu_util_percent"] is None else f"{p['gpu_util_percent']:.0f}"
        table.add_row(
            escape(p["id"]), escape(p["name"]), p["status"], f"{p['uptime_s'] / 3600:.2f} h", gpu,
            f"{p['cost_per_hr']:.2f}", f"{p['spent_usd']:.2f}", "yes" if p["moetune"] else "no",
        )  # fmt: skip
    console.print(table)


@pods_app.command("reap")
@friendly
def pods_reap(
    pod_id: Annotated[str, typer.Argument(help="The pod id (never a name).")],
    config: ConfigOpt = None,
    provider: ProviderOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Terminate one pod moetune recorded, by its id, and ledger what it cost."""
    # lazy: the stage loads only when its command runs
    from moetune.lane.guard import reap

    prov, ledger = _pods_context(config, provider)
    spent = reap(prov, ledger, pod_id, _own_ids(ledger))
    if as_json:
        emit_json({"terminated": pod_id, "spent_usd": spent})
    else:
        console.print(f"terminated {escape(pod_id)} (${spent:.2f})")


@pods_app.command("sweep")
@friendly
def pods_sweep(
    config: ConfigOpt = None,
    provider: ProviderOpt = None,
    yes: Annotated[bool, typer.Option("--yes", help="Terminate; without it, only list.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Terminate moetune's own pods that no live run holds – by recorded id, never by name."""
    # lazy: the stage loads only when its command runs
    from moetune.lane.guard import held_pod_ids, reap, sweep_targets

    prov, ledger = _pods_context(config, provider)
    lane_dir = Path(ledger.path).parent / "lane"
    own = _own_ids(ledger)
    targets = sweep_targets(prov.list(), own, held_pod_ids(lane_dir))
    done = {p.id: reap(prov, ledger, p.id, own) for p in targets} if yes else {}
    if as_json:
        emit_json({"targets": [p.id for p in targets], "terminated": done})
        return
    for p in targets:
        what = f"terminated (${done[p.id]:.2f})" if p.id in done else "would terminate (--yes)"
        console.print(f"{escape(p.id)} {escape(p.name)}: {what}")
    if not targets:
        err_console.print("no orphaned moetune pods")


# ---------------------------------------------------------------- workflows

workflow_app = typer.Typer(help="CI workflows that run a launch with every timeout wall in place.")
app.add_typer(workflow_app, name="workflow")


def _refuse_workflow_out(out: Path) -> None:
    """--out: a writable file path that holds nothing of the user's (a workflow this command
    wrote before is rewritten)."""
    # lazy: the stage loads only when its command runs
    from moetune.lane.providers.base import LaneError
    from moetune.lane.workflows import GENERATED_MARK

    if problem := output_problem(out, (GENERATED_MARK.encode(),), "a workflow"):
        raise LaneError(f"workflow --out {clip(out, 100)} {problem}", "pass --out a new file path")


@workflow_app.command("github")
@friendly
def workflow_github(
    config: Annotated[Path, typer.Argument(help="The run.yaml the workflow launches.")],
    out: Annotated[Path | None, typer.Option(help="Write here instead of stdout.")] = None,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A GitHub Actions workflow: step timeout inside the job's, upload + teardown always."""
    # lazy: the stage loads only when its command runs
    from moetune.lane.launch import launch_plan
    from moetune.lane.workflows import github_workflow
    from moetune.plan.cost.walls import DEFAULT_WATCHDOG_S

    if out:
        _refuse_workflow_out(out)
    cfg = _config(config, None, overrides)
    total = launch_plan(cfg).estimate.total_s
    deadline = int(total or DEFAULT_WATCHDOG_S)
    text = github_workflow(cfg, str(config), deadline, overrides=overrides or [])
    if out:
        atomic_write_text(out, text)
    if as_json:  # the workflow's text too when it went to --out: one document either way
        emit_json({"workflow": text, "out": str(out) if out else None, "deadline_s": deadline})
    elif out:
        err_console.print(f"wrote {escape(str(out))}")
    else:
        console.print(text, markup=False, highlight=False, soft_wrap=True)
