"""`moetune quickstart --stack mlx`: the embedded demo trained by mlx-lm (Linux CPU or Apple
silicon) learns the new skill, keeps the old ones and gets the gate's verdict on the same
ladder as the peft run. Several minutes on 2 shared CPU cores: opt-in (-m slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.cli import app

pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'moetune[mlx]')")


@pytest.mark.slow
def test_quickstart_mlx_learns_the_skill_and_gets_a_verdict(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    args = ["quickstart", "--stack", "mlx", "--out", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["coverage"] == 1.0 and summary["router_changed"] is False
    new = summary["scores"][summary["new_skill"]]
    assert new["base"] < 0.2 and new["candidate"] > 0.8  # learned through mlx-lm
    for name in ("copy", "rev", "first"):
        assert summary["scores"][name]["candidate"] >= summary["scores"][name]["base"] - 0.1
    assert summary["verdict"] == "GO" and summary["promoted"]  # measured: all 6 rungs pass
    config = (out / "finetune" / "mlx" / "lora.yaml").read_text()
    assert "learning_rate: 0.001" in config and "iters: 300" in config
    assert summary["overfit"]["verdict"] == "NO-GO"
