"""The embedded default end to end: the fine-tune learns the new skill, keeps the old
ones, reaches every expert and leaves the router untouched."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from moetune.cli import app


def test_quickstart_json_pipeline(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    result = CliRunner().invoke(app, ["quickstart", "--out", str(out), "--steps", "200", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["coverage"] == 1.0
    assert summary["router_changed"] is False
    assert Path(summary["adapter_dir"], "adapter_model.safetensors").is_file()
    scores = summary["scores"]
    new = scores[summary["new_skill"]]
    assert new["base"] < 0.2 and new["candidate"] > 0.8  # learned
    for name in ("copy", "rev", "first"):
        assert scores[name]["candidate"] >= scores[name]["base"] - 0.1  # kept
    assert json.loads((out / "quickstart.json").read_text())["scores"] == scores
