"""`moetune sky-task`: the run as a SkyPilot task YAML, for `sky launch` by hand.

Registered on moetune's one typer app (imported at the end of cli.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from moetune.cli.common import JsonOpt, SetOpt, app, console, emit_json, friendly
from moetune.cli.options import opt, option_overrides
from moetune.config import load_config


@app.command(name="sky-task")
@friendly
def sky_task_cmd(
    config: Annotated[Path, typer.Argument(help="The run.yaml to launch.")],
    out: Annotated[
        Path, typer.Option("--out", help="Folder for task.yaml and the pod's run.yaml.")
    ] = Path("sky-task"),
    nnodes: Annotated[int | None, opt("nnodes", "Nodes (num_nodes), node 0 the head.")] = None,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A SkyPilot task for the run: resources from the plan, walls, mounts, autostop(down)."""
    # lazy: the stage loads only when its command runs
    from moetune.lane.providers.skypilot import write_task

    extra = option_overrides(nnodes=nnodes)
    path, task = write_task(load_config(config, [*(overrides or []), *extra]), out)
    if as_json:
        emit_json({"task_yaml": str(path), "task": task})
        return
    resources = task["resources"]
    nodes = f" × {task['num_nodes']} nodes" if task["num_nodes"] > 1 else ""
    console.print(f"task: {escape(str(path))} · {resources['accelerators']}{nodes} · disk "
                  f"{resources['disk_size']} GB · autostop {resources['autostop']['idle_minutes']} "
                  "min (down)")  # fmt: skip
    console.print(f"launch: sky launch -c {task['name']} {escape(str(path))}")
