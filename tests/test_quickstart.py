"""The embedded default end to end: the sensible fine-tune learns the new skill, keeps the
old ones, reaches every expert, leaves the router untouched, passes the gate and is
promoted; the over-trained tiny pack is refused by the gate on a protected rung. Both
verdicts are what training produced."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from moetune.cli import app
from moetune.ledger import Ledger


def test_quickstart_json_pipeline(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    result = CliRunner().invoke(app, ["quickstart", "--out", str(out), "--json"])
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

    # the gate: GO and promoted, with the verdict's hash in the marker
    assert summary["verdict"] == "GO"
    verdict = json.loads(Path(summary["results_dir"], "verdict.json").read_text())
    assert json.loads(Path(summary["promoted"]).read_text())["verdict_hash"] == verdict["hash"]

    # the over-trained tiny pack: NO-GO on a protected rung, never promoted
    bad = summary["overfit"]
    assert bad["verdict"] == "NO-GO" and bad["promoted"] is None
    bad_verdict = json.loads(Path(bad["results_dir"], "verdict.json").read_text())
    failed = [r for r in bad_verdict["rungs"] if r["status"] == "fail"]
    assert any(r["role"] == "protected" for r in failed)
    assert not Path(bad["adapter_dir"], "PROMOTED").exists()

    # every attempt in one ledger; a report per run
    kinds = [(r.kind, r.run_id) for r in Ledger(summary["ledger"]).read().rows]
    sensible = [("train", "finetune"), ("eval", "finetune"), ("gate", "finetune")]
    assert kinds == [*sensible, ("promote", "finetune"), *[(k, "overfit") for k, _ in sensible]]
    for run in (summary, bad):
        html = Path(run["report"]).read_text()
        assert run["verdict"] in html and "data:image/png;base64," in html
    assert json.loads((out / "quickstart.json").read_text())["scores"] == scores
