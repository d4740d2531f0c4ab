"""GitHub Actions workflows that run `moetune launch` with wall 4 handled (docs/knowledge.md §8).

A job-level `timeout-minutes` cancels the whole job, and a cancelled job gives its
`if: always()` steps no time: the adapter is never uploaded and the pod keeps billing. So the
launch step gets its own, shorter timeout – a timed-out *step* fails, the job goes on, and the
teardown and upload steps run inside the job's remaining minutes. `check_timeouts` checks the
same properties on any workflow text, ours or hand-edited.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import yaml

from moetune.config import RunConfig, load_yaml
from moetune.errors import ConfigError
from moetune.lane.providers import provider_class
from moetune.plan.cost import walls

SETUP_MINUTES = 10  # checkout + setup-python + pip install on a hosted runner
TEARDOWN_STEP_MINUTES = 10  # the sweep; the rest of CI_TEARDOWN_MINUTES is the upload's
UPLOAD_STEP_MINUTES = walls.CI_TEARDOWN_MINUTES - TEARDOWN_STEP_MINUTES
DEFAULT_INSTALL = "pip install moetune"
DEFAULT_TEARDOWN = "moetune pods sweep --yes"
LAUNCH_MARKER = "moetune launch"
UPLOAD_ACTION = "actions/upload-artifact"
_SECRET_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class CiTimeouts:
    """The job's and the launch step's timeout-minutes, and why they differ from the config."""

    job_minutes: int
    step_minutes: int
    notes: tuple[str, ...] = ()


def _job_minutes(cfg: RunConfig, estimated_total_s: int, notes: list[str]) -> int:
    job = cfg.lane.ci_job_timeout_minutes
    if job is None:
        work = math.ceil(walls.required_watchdog_s(estimated_total_s, 0) / 60)
        job = SETUP_MINUTES + work + walls.CI_TEARDOWN_MINUTES
    if job <= SETUP_MINUTES + walls.CI_TEARDOWN_MINUTES:
        raise ConfigError(
            f"lane.ci_job_timeout_minutes {job} leaves the launch no time after setup "
            f"({SETUP_MINUTES} min) and teardown + upload ({walls.CI_TEARDOWN_MINUTES} min)",
            f"set it above {SETUP_MINUTES + walls.CI_TEARDOWN_MINUTES}, or leave it unset",
        )
    if job > walls.HOSTED_RUNNER_JOB_CAP_MINUTES:
        notes.append(f"job timeout {job} min lowered to the hosted-runner cap")
    return min(job, walls.HOSTED_RUNNER_JOB_CAP_MINUTES)


def ci_timeouts(cfg: RunConfig, estimated_total_s: int) -> CiTimeouts:
    """Job: the configured one, else setup + the estimate with the watchdog's margin +
    teardown, at most the hosted-runner cap. Step: the configured one, lowered when it would
    not leave the setup steps before it and the teardown steps after it their minutes."""
    notes: list[str] = []
    job = _job_minutes(cfg, estimated_total_s, notes)
    longest = walls.max_step_timeout_minutes(job - SETUP_MINUTES)  # setup runs first
    step = cfg.lane.ci_step_timeout_minutes
    if step is not None and step > longest:
        notes.append(f"step timeout {step} min lowered to {longest} (setup + teardown)")
    step = longest if step is None else min(step, longest)
    if estimated_total_s * walls.WATCHDOG_MARGIN > step * 60:
        hours = estimated_total_s * walls.WATCHDOG_MARGIN / 3600
        notes.append(f"the estimate with margin ({hours:.1f} h) overruns the step; "
                     "continue with `moetune launch --resume`")  # fmt: skip
    return CiTimeouts(job, step, tuple(notes))


def _check_inputs(cfg: RunConfig, config_path: str, overrides: Sequence[str]) -> None:
    """Refuse what would break the YAML or be expanded by Actions inside a `run:` line."""
    for text in (config_path, *overrides):
        if "${{" in text or "\n" in text or "\r" in text:
            raise ConfigError(
                f"config path or override {text!r} has a newline or a `${{{{` expression",
                "rename the file / write the override without them",
            )
    for name, where in _secret_names(cfg).items():
        if not _SECRET_NAME.fullmatch(name):
            raise ConfigError(
                f"{where} {name!r} cannot be a GitHub secret name",
                "use letters, digits and underscores, e.g. RUNPOD_API_KEY",
            )


def _secret_names(cfg: RunConfig) -> dict[str, str]:
    return provider_class(cfg.lane.provider).secret_names(cfg.lane)


def _secret_env(cfg: RunConfig) -> dict[str, str]:
    """Secrets by reference only: the key text is never in the workflow."""
    return {name: f"${{{{ secrets.{name} }}}}" for name in _secret_names(cfg)}


def _artifact_paths(cfg: RunConfig) -> str:
    """The run dir (banked adapter, metrics), eval results and the ledger, one per line."""
    out = cfg.output.dir
    paths: list[PurePath] = []
    for path in (PurePath(out), cfg.eval.results_path(out), PurePath(cfg.output.ledger)):
        if not any(path.is_relative_to(p) for p in paths):  # inside the run dir already
            paths.append(path)
    return "".join(f"{p}\n" for p in paths)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings as `|` blocks, as people write them in workflows."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _steps(
    cfg: RunConfig,
    config_path: str,
    step_min: int,
    commands: tuple[str, str],
    overrides: Sequence[str],
) -> list[dict[str, Any]]:
    install, teardown = commands
    secrets = _secret_env(cfg)
    target = f"{shlex.quote(config_path)} --provider {cfg.lane.provider}"
    sets = "".join(f" --set {shlex.quote(o)}" for o in overrides)
    return [
        {"uses": "actions/checkout@v4"},
        {"uses": "actions/setup-python@v5", "with": {"python-version": "3.11"}},
        {"name": "Install moetune", "run": install},
        {
            "name": "Launch",
            "timeout-minutes": step_min,  # shorter than the job's: the steps below still run
            "env": {walls.XET_ENV: "1", **secrets},
            "run": f"{LAUNCH_MARKER} {target}{sets}",
        },
        {
            "name": "Tear down orphaned pods",
            "if": "always()",
            "timeout-minutes": TEARDOWN_STEP_MINUTES,
            **({"env": secrets} if secrets else {}),
            "run": f"{teardown} --config {target}",  # the run's ledger knows its pods
        },
        {
            "name": "Upload adapter, results and ledger",
            "if": "always()",
            "timeout-minutes": UPLOAD_STEP_MINUTES,
            "uses": f"{UPLOAD_ACTION}@v4",
            "with": {"name": "moetune-run", "path": _artifact_paths(cfg)},
        },
    ]


def github_workflow(
    cfg: RunConfig,
    config_path: str,
    estimated_total_s: int,
    install: str = DEFAULT_INSTALL,
    teardown: str = DEFAULT_TEARDOWN,
    overrides: Sequence[str] = (),
) -> str:
    """A workflow_dispatch workflow running `moetune launch` for `cfg` on ubuntu-latest.

    The launch step's timeout ends `walls.CI_TEARDOWN_MINUTES` or more before the job's, so
    the `if: always()` teardown (first: it stops the spend) and upload steps always get to run.
    `overrides` (`section.field=value`, as given to `--set`) are passed on to the launch.
    """
    _check_inputs(cfg, config_path, overrides)
    t = ci_timeouts(cfg, estimated_total_s)
    doc = {
        "name": "moetune launch",
        "on": {"workflow_dispatch": {}},
        "permissions": {"contents": "read"},
        "jobs": {
            "launch": {
                "runs-on": "ubuntu-latest",
                "timeout-minutes": t.job_minutes,
                "steps": _steps(cfg, config_path, t.step_minutes, (install, teardown), overrides),
            }
        },
    }
    body = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=1000, allow_unicode=True)
    return _header(config_path, t) + body


GENERATED_MARK = "# Generated by `moetune workflow"  # how a file this module wrote begins


def _header(config_path: str, t: CiTimeouts) -> str:
    lines = [
        f"Generated by `moetune workflow github {config_path}`.",
        f"Launch step {t.step_minutes} min inside a {t.job_minutes} min job: a timed-out step",
        "still leaves the if: always() teardown and upload steps their time.",
        *(f"NOTE: {note}" for note in t.notes),
    ]
    return "".join(f"# {line}\n" for line in lines)


# ---------------------------------------------------------------- checking any workflow


def _minutes(value: Any) -> float | None:
    """A literal timeout in minutes; None when absent or an expression we cannot evaluate."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _is_launch(step: dict[str, Any]) -> bool:
    return LAUNCH_MARKER in str(step.get("run", ""))


def _dict_steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    steps = job.get("steps")
    return [s for s in steps if isinstance(s, dict)] if isinstance(steps, list) else []


def _launch_timeout(job_id: str, job_min: float, step: dict[str, Any]) -> list[str]:
    step_min = _minutes(step.get("timeout-minutes"))
    limit = job_min - walls.CI_TEARDOWN_MINUTES
    if step_min is None:
        return [
            f"job {job_id}: the launch step has no numeric timeout-minutes, so at the job's "
            f"{job_min:g} min the whole job is cancelled – set one below {limit:g}"
        ]
    if step_min >= limit:
        return [
            f"job {job_id}: launch step timeout {step_min:g} min is not "
            f"{walls.CI_TEARDOWN_MINUTES} min inside the job's {job_min:g} that setup and "
            f"teardown need – set it below {limit:g}"
        ]
    return []


def _always_steps(job_id: str, after: list[dict[str, Any]], teardown: str) -> list[str]:
    """Upload and teardown steps must exist after the launch and run whatever it did."""
    problems: list[str] = []
    kinds = {
        "upload": [s for s in after if str(s.get("uses", "")).startswith(UPLOAD_ACTION)],
        "teardown": [s for s in after if teardown in str(s.get("run", ""))],
    }
    for what, found in kinds.items():
        if not found:
            problems.append(f"job {job_id}: no {what} step after the launch step")
        problems += [
            f"job {job_id}: {what} step {s.get('name', '(unnamed)')!r} lacks `if: always()`, "
            "so it is skipped when the launch step fails or times out"
            for s in found
            if "always()" not in str(s.get("if", ""))
        ]
    return problems


def _check_job(job_id: str, job: dict[str, Any], teardown: str) -> list[str]:
    steps = _dict_steps(job)
    at = next(i for i, s in enumerate(steps) if _is_launch(s))
    # GitHub's default job timeout is the hosted-runner cap
    job_min = _minutes(job.get("timeout-minutes", walls.HOSTED_RUNNER_JOB_CAP_MINUTES))
    if job_min is None:
        return [f"job {job_id}: timeout-minutes is not a number, so it cannot be checked"]
    return _launch_timeout(job_id, job_min, steps[at]) + _always_steps(
        job_id, steps[at + 1 :], teardown
    )


def check_timeouts(text: str, teardown: str = DEFAULT_TEARDOWN) -> list[str]:
    """Problems with wall 4 in a workflow's text: the launch step's timeout missing or not
    `CI_TEARDOWN_MINUTES` inside the job's, upload/teardown steps without `if: always()`.
    A job without `timeout-minutes` has GitHub's default, the hosted-runner cap."""
    try:
        doc = load_yaml(text)
    except yaml.YAMLError as err:
        return [f"not valid YAML: {str(err).splitlines()[0]}"]
    jobs = doc.get("jobs") if isinstance(doc, dict) else None
    launching = {
        str(job_id): job
        for job_id, job in (jobs if isinstance(jobs, dict) else {}).items()
        if isinstance(job, dict) and any(_is_launch(s) for s in _dict_steps(job))
    }
    if not launching:
        return [f"no job has a step that runs `{LAUNCH_MARKER}`"]
    return [p for job_id, job in launching.items() for p in _check_job(job_id, job, teardown)]
