"""Every script in benchmarks/ runs: its --smoke mode, in its own process, as a user would
start it – so a renamed config field or API breaks the suite, not the next measurement.

The scripts are found on disk (a new one is covered by itself); each must pin its threads
through bench_env before torch loads, take --smoke, and leave RESULTS.md untouched there.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if '__name__ == "__main__"' in p.read_text())
# What each smoke run must print (its figures), and the arguments it needs besides --smoke.
EXPECT: dict[str, tuple[list[str], str]] = {
    "cli_sweep.py": ([], r"cases: 4 · OK 4"),
    "demo_base.py": (["mixed"], r'"step": 2, "train_s"'),
    "census_tiers.py": ([], r'"passed": \{"count": 3, "recipe": 3, "plan": 3\}'),
    "experts_lora.py": ([], r"speed.*\d"),
    "gemma4_terms.py": ([], r"\| census shape .*\| 128 \| \d+\.\d / \d+\.\d \|"),
    "gpu_validate.py": (["--cases", "30b-peft-2k", "--no-tracker"], r"30b-peft-2k"),
    "kt_kernel.py": ([], r"CPU .*; flags: "),  # without kt-kernel (its own venv): flags + why
    "grpo_step.py": ([], r"\| 4 \| \d+\.\d+ \| \d+\.\d+ \|"),
    "planner_accuracy.py": ([], r"worst: [+-]\d+\.\d %"),
    "sharded_load.py": ([], r"rank 1: peak RSS \d+\.\d+ GiB.*plan \d+\.\d+ GiB"),
    "sharding_accuracy.py": ([], r"world 2 rank 1: measured \d+\.\d+ MiB, planned"),
    "stored_offload.py": ([], r"\| peak RSS of `moetune train` \| \d+\.\d+ .iB .*\| \d\.\d+ \|"),
    "trace_speed.py": ([], r"peak +\d+\.\d+ GiB"),
}


# Scripts whose --smoke a test of their own already runs in a subprocess (not run twice).
COVERED = {"offload_disk.py": ("test_train_offload.py", "test_disk_benchmark_smoke")}


def _digest() -> str:
    return hashlib.sha256((BENCH / "RESULTS.md").read_bytes()).hexdigest()


def test_every_script_is_known_and_pins_its_threads() -> None:
    assert set(SCRIPTS) == set(EXPECT) | set(COVERED), "a benchmark without a smoke test"
    for test_file, test_name in COVERED.values():
        text = (BENCH.parent / "tests" / test_file).read_text()
        assert f"def {test_name}(" in text and '"--smoke"' in text
    for name in SCRIPTS:
        text = (BENCH / name).read_text()
        assert re.search(r"^import bench_env$", text, re.M), f"{name}: bench_env not imported"
        assert (
            text.index("import bench_env") < text.index("import torch")
            if "import torch" in text
            else True
        )
        assert '"--smoke"' in text, f"{name} has no --smoke"


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_smoke_run(name: str, tmp_path: Path) -> None:
    args, pattern = EXPECT[name]
    before = _digest()
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HOME": str(tmp_path), "OUT": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(BENCH / name), *args, "--smoke"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(pattern, done.stdout), done.stdout[-3000:]
    assert _digest() == before, f"{name} --smoke wrote to RESULTS.md"
