"""Issue 48 (fourth hardening pass): a stdout that takes no more ended in exit 3 ("unexpected
OSError") – `moetune … > /dev/full`, or a reader that left (`moetune … | head`). A full
stdout is now one line on stderr (exit 2, the output is incomplete); a reader that left is
a quiet exit 1, no traceback, no "Exception ignored" at the interpreter's exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import moetune
from moetune.cli import app
from moetune.demo.base import SHIPPED_DIR

SRC = Path(moetune.__file__).parents[1]
ENV = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["schema"], ["schema", "--json"]])
def test_a_full_stdout_is_one_line_exit_2(args: list[str]) -> None:
    with open("/dev/full", "wb") as full:
        done = subprocess.run([sys.executable, "-m", "moetune", *args], env=ENV, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert lines == [
        "error: stdout could not be written (No space left on device); the output is "
        "incomplete fix: send stdout to a disk with free space"
    ]


def test_a_reader_that_left_is_a_quiet_exit() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write
    done = subprocess.run([sys.executable, "-m", "moetune", "schema"], env=ENV, stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    os.close(write)
    assert done.returncode == 1, done.stderr
    assert "error" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


def test_a_5000_character_output_dir_is_one_short_line(tmp_path: Path) -> None:
    """Before: exit 2, but the line repeated the whole 5,000-character path and called the
    dir "not writable"."""
    deep = tmp_path.joinpath(*["d" * 200] * 25)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "copy:ab>", "completion": "ab"}\n' * 4)
    config = {"model": {"id": str(SHIPPED_DIR)}, "data": {"train_file": str(data)},
              "output": {"dir": str(deep), "ledger": str(tmp_path / "l.jsonl")},
              "train": {"seq_len": 64}}  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    out = CliRunner().invoke(app, ["train", str(tmp_path / "run.yaml")])
    assert out.exit_code == 2 and "Traceback" not in out.output, out.output
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert len(line) < 400 and "the path is too long" in line and "shorten output.dir" in line
