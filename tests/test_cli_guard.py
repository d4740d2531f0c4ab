"""No traceback reaches a user: inputs that used to end in one give a one-line cause and fix
(exit 2), anything unforeseen one line naming the exception (exit 3) – and `--debug` or
MOETUNE_DEBUG=1 shows the traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.cli.common import UNEXPECTED
from moetune.demo.base import SHIPPED_DIR

runner = CliRunner()


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = runner.invoke(app, list(args), env=env)
    return result.exit_code, result.output


def assert_one_line(code: int, out: str, expected: int, *needles: str) -> None:
    assert code == expected, out
    lines = [line for line in out.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in out, out
    for needle in needles:
        assert needle in lines[0], out


def test_binary_run_yaml(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_bytes(b"model:\n  id: \x00\xff\xfe\x80 binary\n")
    assert_one_line(*run("lint", str(config)), 2, "not UTF-8 text", "fix:")
    config.write_bytes(b"model: {id: a\x00b}\n")  # UTF-8, but YAML forbids NUL
    assert_one_line(*run("lint", str(config)), 2, "not valid YAML", "fix:")


def test_unclosed_set_list() -> None:
    code, out = run("lint", "Qwen/Qwen3-30B-A3B", "--set", "lora.targets=[attention")
    assert_one_line(code, out, 2, "--set lora.targets", "not valid YAML", "fix:")


def test_hub_id_of_300_characters() -> None:
    code, out = run("inspect", "owner/" + "m" * 294)
    assert_one_line(code, out, 2, "not a valid hub model id", "96 characters")


@pytest.mark.parametrize("command", ["inspect", "plan", "lint", "train", "eval"])
def test_path_of_5000_characters(command: str) -> None:
    suffix = ".yaml" if command in ("train", "eval") else ""
    code, out = run(command, "a" * 5000 + suffix)
    assert_one_line(code, out, 2, "too long", "fix:")
    assert len(out) < 400  # the path is clipped, not echoed


def test_run_yaml_that_is_a_directory(tmp_path: Path) -> None:
    folder = tmp_path / "run.yaml"
    folder.mkdir()
    assert_one_line(*run("train", str(folder)), 2, "is a directory", "fix:")


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ({"hidden_size": 256}, "tensor shapes differ"),
        ({"num_hidden_layers": 4}, "tensors it builds are not in the weights"),
    ],
    ids=["shapes", "extra-layer"],
)
def test_config_json_that_does_not_match_the_weights(
    tmp_path: Path, edit: dict[str, int], needle: str
) -> None:
    base = Path(shutil.copytree(SHIPPED_DIR, tmp_path / "base"))
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, **edit}))
    data = tmp_path / "items.jsonl"
    data.write_text(json.dumps({"prompt": "a", "answer": "b"}) + "\n")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    lora = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (adapter / "adapter_config.json").write_text(json.dumps(lora))  # a valid one: the base fails
    config = tmp_path / "run.yaml"
    rung = {"name": "r", "kind": "exact_match", "data": str(data)}
    config.write_text(
        json.dumps(
            {
                "model": {"id": str(base), "dtype": "float32"},
                "train": {"device": "cpu"},
                "output": {"dir": str(tmp_path / "run"), "ledger": str(tmp_path / "l.jsonl")},
                "eval": {"rungs": [rung]},
            }
        )
    )
    code, out = run("eval", str(config), "--adapter", str(adapter))
    assert_one_line(code, out, 2, "does not match its weights", needle, "fix:")


# ---------------------------------------------------------------- the guard itself


@pytest.fixture
def broken_doctor(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object) -> None:  # doctor's own arguments, ignored
        raise ZeroDivisionError("an internal slip\nsecond line")

    monkeypatch.setattr("moetune.lint.doctor.run_doctor", boom)


@pytest.mark.usefixtures("broken_doctor")
def test_unexpected_exception_is_one_line_naming_its_type() -> None:
    code, out = run("doctor")
    assert_one_line(code, out, UNEXPECTED, "unexpected ZeroDivisionError", "--debug")
    assert "an internal slip second line" in out  # the message, flattened to the one line


@pytest.mark.usefixtures("broken_doctor")
@pytest.mark.parametrize("how", ["option", "env"])
def test_debug_shows_the_traceback(how: str) -> None:
    args, env = (
        (["--debug", "doctor"], None) if how == "option" else (["doctor"], {"MOETUNE_DEBUG": "1"})
    )
    result = runner.invoke(app, args, env=env)
    assert result.exit_code != 0
    assert isinstance(result.exception, ZeroDivisionError)  # re-raised: Python prints it


def test_moetune_errors_keep_exit_2_and_commands_keep_their_codes(tmp_path: Path) -> None:
    code, out = run("lint", str(tmp_path / "missing.yaml"))
    assert_one_line(code, out, 2, "not found", "fix:")
    assert run("version")[0] == 0
    assert run("lint", "--no-such-option")[0] == 2  # typer's usage error, untouched


def test_nul_byte_in_a_path() -> None:
    assert_one_line(*run("lint", "a\x00b.yaml"), 2, "NUL byte", "fix:")


def test_quickstart_steps_below_one_refused(tmp_path: Path) -> None:
    code, out = run("quickstart", "--steps", "0", "--out", str(tmp_path / "qs"))
    assert_one_line(code, out, 2, "--steps 0", "fix:")
    assert not (tmp_path / "qs").exists()


def test_permission_denied_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(*_: object) -> None:  # doctor's own arguments, ignored
        raise PermissionError(13, "Permission denied", "/srv/runs/x")

    monkeypatch.setattr("moetune.lint.doctor.run_doctor", denied)
    assert_one_line(*run("doctor"), 2, "/srv/runs/x: permission denied", "fix:")


def test_the_real_entry_point_prints_one_line(tmp_path: Path) -> None:
    """`python -m moetune` (what the console script and pods run), not only CliRunner."""
    import os
    import subprocess
    import sys

    config = tmp_path / "run.yaml"
    config.write_bytes(b"\xff\xfe\x00\x01 not yaml")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "moetune", "lint", str(config)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert_one_line(done.returncode, done.stdout + done.stderr, 2, "not UTF-8 text", "fix:")


@pytest.mark.parametrize(
    ("raised", "code", "word"), [(KeyboardInterrupt(), 130, "Ctrl-C"), (None, 143, "SIGTERM")]
)
def test_an_interrupt_is_one_line_saying_what_was_kept(
    monkeypatch: pytest.MonkeyPatch, raised: KeyboardInterrupt | None, code: int, word: str
) -> None:
    from moetune.ledger import Terminated

    def stopped(*_: object) -> None:  # doctor's own arguments, ignored
        raise raised if raised is not None else Terminated()

    monkeypatch.setattr("moetune.lint.doctor.run_doctor", stopped)
    got, out = run("doctor")
    assert got == code
    # doctor is not train: the fix reruns it and offers no --resume that cannot help
    assert word in out and "rerun the same command" in out and "--resume" not in out
    assert "Traceback" not in out
    assert len(out.strip().splitlines()) == 1
