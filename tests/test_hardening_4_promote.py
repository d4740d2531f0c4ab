"""Issue 48 (fourth hardening pass), promotion across a copied or moved run dir: a gate run
on a copy's results marks the copy's adapter – never the original's, outside the dir it was
given – and a model card (README.md) edited in a promoted adapter neither breaks the
promotion nor hides which weight file changed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from export_fixtures import make_run
from moetune.cli import app
from moetune.io import PROMOTED, promotion_broken


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run dir whose adapter changes nothing (B = 0), evaluated (GO), not yet gated."""
    run = make_run(tmp_path_factory.mktemp("h4p"), "olmoe", scale=0.0)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["eval"]["rungs"][0]["margin"] = 1.0  # six items decide only with a wide margin
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    out = CliRunner().invoke(app, ["eval", str(run / "config.yaml"), "--json"])
    assert out.exit_code == 0 and json.loads(out.stdout)["verdict"] == "GO", out.output
    return run


def _gate(results: Path) -> None:
    out = CliRunner().invoke(app, ["gate", str(results), "--promote", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["promoted"] == str(results.parent / "adapter" / PROMOTED)


@pytest.mark.parametrize("how", ["copied", "moved"])
def test_a_gate_in_a_copied_or_moved_run_marks_only_that_runs_adapter(
    evaluated: Path, tmp_path: Path, how: str
) -> None:
    source = tmp_path / "original"
    shutil.copytree(evaluated, source)
    other = tmp_path / "elsewhere" / "run"
    if how == "copied":
        shutil.copytree(source, other)
    else:
        other.parent.mkdir()
        source.rename(other)
    original = json.loads((other / "eval" / "ladder.json").read_text())["adapter"]
    _gate(other / "eval")
    assert (other / "adapter" / PROMOTED).is_file()
    assert not (Path(original) / PROMOTED).exists()  # the run it was evaluated in: untouched
    assert not (source / "adapter" / PROMOTED).exists()


def test_an_edited_model_card_keeps_the_promotion_and_a_changed_file_is_named(
    evaluated: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(evaluated, run)
    _gate(run / "eval")
    adapter = run / "adapter"
    assert (adapter / "README.md").is_file()  # peft's save_pretrained writes a model card
    (adapter / "README.md").write_text("# my notes on this adapter\n")
    assert promotion_broken(adapter) is None
    with (adapter / "adapter_config.json").open("a") as fh:
        fh.write("\n")
    why = promotion_broken(adapter)
    assert why is not None and "adapter_config.json" in why, why


def test_results_copied_away_from_an_adapter_kept_outside_the_run_are_refused(
    evaluated: Path, tmp_path: Path
) -> None:
    run, adapter = tmp_path / "run", tmp_path / "kept" / "adapter"
    shutil.copytree(evaluated, run, ignore=shutil.ignore_patterns("eval"))
    adapter.parent.mkdir()
    (run / "adapter").rename(adapter)
    config = yaml.safe_load((evaluated / "config.yaml").read_text())
    config["output"]["dir"] = str(run)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    out = CliRunner().invoke(app, ["eval", str(run / "config.yaml"), "--adapter", str(adapter)])
    assert out.exit_code == 0, out.output
    copy = tmp_path / "deeper" / "copy"
    shutil.copytree(run, copy)
    refused = CliRunner().invoke(app, ["gate", str(copy / "eval"), "--promote"])
    assert refused.exit_code == 2 and "Traceback" not in refused.output, refused.output
    assert "copied or moved away from the adapter it evaluated" in refused.stderr
    assert not (adapter / PROMOTED).exists()
    out = CliRunner().invoke(app, ["gate", str(run / "eval"), "--promote"])  # where it was
    assert out.exit_code == 0 and (adapter / PROMOTED).is_file(), out.output
