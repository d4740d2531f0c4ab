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

import moetune

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
