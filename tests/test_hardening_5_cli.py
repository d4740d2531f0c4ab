"""Issue 48 (fifth hardening pass), the CLI: what reaches a command from its shell – a `--set`
value with a line break in it – is refused in one line (exit 2, one JSON object with --json)
before anything is built, never folded into a value nobody typed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import load_config

runner = CliRunner()


def _run_yaml(tmp_path: Path) -> str:
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"model": {"id": "Qwen/Qwen3-30B-A3B"}}), encoding="utf-8")
    return str(config)


@pytest.mark.parametrize(
    "assignment",
    [
        "output.dir=out\nlater",  # YAML folds it to "out later": a dir nobody named
        "output.dir=out\nmodel: x",  # a second key read from the value
        "train.seq_len=64\r",
        "lane.env={TOKEN: hunter2\x1b[2J}",  # a terminal escape, in a secret
    ],
)
def test_a_control_character_in_a_set_value_is_refused_in_one_line(tmp_path, assignment):
    config = _run_yaml(tmp_path)
    result = runner.invoke(app, ["plan", config, "--set", assignment])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert "\n" not in line and "control character" in line and "Traceback" not in line
    assert "hunter2" not in result.output  # the value may be a secret: never shown
    error = json.loads(runner.invoke(app, ["plan", config, "--set", assignment, "--json"]).stdout)
    assert error["error"]["exit_code"] == 2 and "control character" in error["error"]["cause"]
    assert not (tmp_path / "out").exists()


def test_the_same_value_on_one_line_is_read(tmp_path):
    assert load_config(_run_yaml(tmp_path), ["train.seq_len=64"]).train.seq_len == 64


@pytest.mark.parametrize("command", ["lint", "plan", "data", "train", "eval", "quickstart"])
def test_a_deleted_working_directory_is_named_not_not_found(tmp_path, monkeypatch, command):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()  # `cd d && rmdir ../d`: the shell still stands in it
    args = [command] if command == "quickstart" else [command, "run.yaml"]
    result = runner.invoke(app, [*args, "--json"])
    error = json.loads(result.stdout)["error"]  # was: "run config run.yaml: not found"
    assert result.exit_code == error["exit_code"] == 2
    assert "working directory no longer exists" in error["cause"] and "cd " in error["fix"]
    assert result.stderr.count("\n") == 1 and "not found" not in result.stderr
    assert runner.invoke(app, ["version"]).exit_code == 0  # a command with no path still runs


@pytest.mark.slow
def test_every_command_on_the_demo_base_runs_with_home_read_only(tmp_path):
    """HOME read-only (and with it the XDG / Hugging Face caches under it): lint, plan, data
    and a two-step train on the demo base, a csv source included (datasets' cache falls back),
    each as its own process, as a user runs them."""
    import os
    import subprocess
    import sys

    from moetune.demo.base import SHIPPED_DIR
    from moetune.io import unwritable

    home = tmp_path / "home"
    home.mkdir(mode=0o555)
    if unwritable(home) is None:  # root passes permission bits: sysfs refuses root's writes
        home = Path("/sys/kernel")
        if unwritable(home) is None:
            pytest.skip("no dir here refuses this user's writes")
    rows = tmp_path / "rows.csv"
    rows.write_text("prompt,completion\n" + "rev:ab>,ba\nrev:cd>,dc\n" * 4, encoding="utf-8")
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "model": {"id": str(SHIPPED_DIR)}, "data": {"sources": [{"path": str(rows)}]},
        "train": {"max_steps": 2, "batch_size": 2, "seq_len": 32, "device": "cpu"},
        "output": {"dir": str(tmp_path / "out"), "ledger": str(tmp_path / "ledger.jsonl")},
    }), encoding="utf-8")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "HF_HOME"))}
    env |= {"HOME": str(home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(sys.path)}  # fmt: skip
    env.pop("HF_DATASETS_CACHE", None)
    for command in ("lint", "plan", "data", "train"):
        done = subprocess.run(
            [sys.executable, "-m", "moetune", command, str(config)],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, (command, done.stderr[-2000:])
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()
