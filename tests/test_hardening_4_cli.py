"""Issue 48 (fourth hardening pass), the CLI: `--json` on bad input is one JSON object on
stdout for every command (the one line still goes to stderr), whatever refused it – moetune
itself or typer's parser."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from moetune.cli import app

runner = CliRunner()


def _leaves(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    subs = getattr(cmd, "commands", None)
    if not subs:
        yield path, cmd
        return
    for name, sub in subs.items():
        yield from _leaves(sub, (*path, name))


COMMANDS = [
    (path, sum(p.param_type_name == "argument" for p in cmd.params))
    for path, cmd in _leaves(typer.main.get_command(app))
    if "--json" in [o for p in cmd.params for o in p.opts]
]


def _one_json_error(result: Any) -> dict[str, Any]:
    got = json.loads(result.stdout)  # the whole of stdout: one object, nothing else
    error = got["error"]
    assert result.exit_code == error["exit_code"] == 2, result.output
    assert error["cause"] and error["fix"] and error["type"]
    assert "Traceback" not in result.output
    return error


def test_every_command_but_version_takes_json() -> None:
    names = {" ".join(path) for path, _ in COMMANDS}
    assert len(names) >= 20 and {"train", "eval", "export", "pods reap", "ledger show"} <= names


@pytest.mark.parametrize(("path", "n_args"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_json_on_bad_input_is_one_json_object_for_every_command(
    tmp_path: Path, path: tuple[str, ...], n_args: int
) -> None:
    error = _one_json_error(runner.invoke(app, [*path, "--json", "--no-such-option"]))
    assert error["type"] == "UsageError" and "--no-such-option" in error["cause"]
    if n_args:  # a missing file where the command wants one: moetune's own refusal
        missing = str(tmp_path / "missing" / "run.yaml")
        result = runner.invoke(app, [*path, *[missing] * n_args, "--json"])
        error = _one_json_error(result)
        assert result.stderr.count("error:") == 1  # the line for a person, as without --json


def test_without_json_stdout_stays_empty_on_bad_input(tmp_path: Path) -> None:
    result = runner.invoke(app, ["lint", str(tmp_path / "missing.yaml")])
    assert (result.exit_code, result.stdout) == (2, "") and "not found" in result.stderr


def _stopped(*_: Any, **__: Any) -> None:
    from moetune.ledger import Terminated

    raise Terminated()


@pytest.mark.parametrize(
    ("args", "target", "says"),
    [
        (["quickstart"], "moetune.demo.quickstart.run_quickstart", "rerun `moetune quickstart`"),
        (["eval", "run.yaml"], "moetune.cli.commands.load_config", "rerun the same `moetune eval"),
        (["train", "run.yaml"], "moetune.cli.commands.load_config", "--resume"),
    ],
)
def test_sigterm_names_the_stopped_commands_own_way_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], target: str, says: str
) -> None:
    """Before: quickstart was told to pass --resume (it has none), eval to `train --resume`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(target, _stopped)
    result = runner.invoke(app, args)
    assert result.exit_code == 143, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("terminated (SIGTERM)") and says in line.split("fix:")[1]
    if args[0] != "train":
        assert "--resume" not in line


HOST = {
    "cpu": "Hand CPU", "cores": 8, "threads": 8, "ram_bytes": 64 * 10**9,
    "measured_at": "2026-12-05T00:00:00Z", "fp32_gflops": 200.0, "bf16_gflops": 400.0,
    "memcpy_gb_per_s": 10.0, "disk_read_gb_per_s": 2.0,
}  # fmt: skip


@pytest.mark.parametrize(
    ("field", "raw", "says"),
    [
        ("fp32_gflops", "Infinity", "finite number"),
        ("fp32_gflops", "1e308", "less than or equal to 1000000"),
        ("disk_read_gb_per_s", "1e-300", "greater than or equal to 0.000001"),
        ("memcpy_gb_per_s", "true", "valid number"),
        ("bf16_gflops", '"400"', "valid number"),
        ("cores", "true", "valid integer"),
    ],
)
def test_host_json_rates_that_cannot_be_a_hosts_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, raw: str, says: str
) -> None:
    from moetune.errors import ConfigError
    from moetune.plan.host import load_host

    path = tmp_path / "host.json"
    text = json.dumps({**HOST, field: "@"}).replace('"@"', raw)
    path.write_text(text, encoding="utf-8")  # was: planned with it (a step of 0 s or ages)
    with pytest.raises(ConfigError) as info:
        load_host(path)
    assert f"{field}: " in info.value.cause and says in info.value.cause
    path.write_text(json.dumps(HOST), encoding="utf-8")
    assert load_host(path) is not None


def test_a_host_file_that_is_a_directory_is_refused_not_ignored(tmp_path: Path) -> None:
    from moetune.errors import ConfigError
    from moetune.plan.host import load_host

    (tmp_path / "host.json").mkdir()
    with pytest.raises(ConfigError, match="is not a file"):  # was: defaults, without a word
        load_host(tmp_path / "host.json")


@pytest.mark.parametrize("extra", [["--probe-mib", "8"], ["--path", "."], ["--file", "x"]])
def test_calibration_options_without_calibrate_are_refused_not_ignored(extra: list[str]) -> None:
    result = runner.invoke(app, ["doctor", *extra])
    assert result.exit_code == 2, result.output  # was: the plain doctor report, exit 0
    assert f"{extra[0]} only apply with --calibrate" in result.stderr


@pytest.mark.parametrize("floor", ["nan", "0", "-0.1", "1.5"])
def test_a_survival_floor_that_is_not_a_share_is_refused(tmp_path: Path, floor: str) -> None:
    args = ["export", str(tmp_path / "run"), "--format", "merged", "--out", str(tmp_path / "o")]
    result = runner.invoke(app, [*args, "--requantize", "--survival-floor", floor])
    assert result.exit_code == 2, result.output  # nan, 0: was accepted, refusing nothing
    assert "is not a share in (0, 1]" in result.stderr and "fix:" in result.stderr
