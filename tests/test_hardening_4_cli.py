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
