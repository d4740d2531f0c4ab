"""Issue 48 (fourth hardening pass), eval and export: an adapter dir whose adapter_config
peft cannot load from, and an --out that is a file, are one line (exit 2, the right cause),
before any model is built – not a KeyError after the base was scored, not "not empty"."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from export_fixtures import make_run
from moetune.cli import app


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("h4"), "olmoe")


def _one_line(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "fix:" in lines[0] and "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ("{}", "names no peft_type"),
        ("[]", "is a JSON list, not an object"),
        ('{"peft_type": "LORA", "r": 2}', "names no target_modules or target_parameters"),
        ('{"peft_type": "LO', "cannot be read as JSON"),
    ],
)
def test_an_adapter_config_peft_cannot_load_is_refused_before_scoring(
    run: Path, tmp_path: Path, config: str, says: str
) -> None:
    adapter = tmp_path / "adapter"
    shutil.copytree(run / "adapter", adapter)
    (adapter / "adapter_config.json").write_text(config, encoding="utf-8")
    results = tmp_path / "results"
    args = ["eval", str(run / "config.yaml"), "--adapter", str(adapter)]
    got = CliRunner().invoke(app, [*args, "--set", f"eval.results_dir={results}"])
    _one_line(got, "adapter_config.json", says)
    assert "eval base" not in got.output and not results.exists()  # nothing scored, written
    out = tmp_path / "merged"
    got = CliRunner().invoke(app, ["export", str(adapter), "--format", "merged", "--out", str(out)])
    _one_line(got, says)  # was: "does not name its base model"
    assert not out.exists()


def test_export_out_an_empty_file_is_named_as_a_file(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.write_text("")
    args = ["export", str(run), "--format", "merged", "--out", str(out), "--no-check"]
    _one_line(CliRunner().invoke(app, args), "is a file, not a folder")  # was: "not empty"
    assert out.read_text() == ""


def test_set_output_dir_on_a_saved_run_config_wins_over_the_run_dir(run: Path, tmp_path: Path):
    """`train RUN/config.yaml --set output.dir=NEW` targeted RUN's finished dir and refused,
    with a fix that said to pass exactly that --set."""
    from moetune.config import load_config

    new = tmp_path / "new"
    cfg = load_config(run / "config.yaml", [f"output.dir={new}", "lora.rank=4"])
    assert (cfg.output.dir, cfg.lora.rank) == (str(new), 4)
    assert Path(cfg.model.id).is_dir()  # the saved run's own paths still found, as rebased
    assert load_config(run / "config.yaml").output.dir == str(run.resolve())


@pytest.mark.parametrize(
    ("line", "says"),
    [('{"prompt": oops', "not valid JSON"), ('{"prompt": "a", "prompt": "b"}', "appears twice")],
)
def test_an_eval_rung_file_with_a_bad_line_says_nothing_about_training(
    run: Path, tmp_path: Path, line: str, says: str
) -> None:
    """Before: eval refused a bad rung line with "…; nothing was trained" (the train reader's)."""
    data = tmp_path / "rung.jsonl"
    data.write_text('{"prompt": "copy:ab>", "answer": "ab"}\n' + line + "\n")
    over = ["--set", f"eval.rungs=[{{name: s, kind: exact_match, data: {data}}}]"]
    out = CliRunner().invoke(app, ["eval", str(run / "config.yaml"), *over])
    first = _one_line(out, "rung 's'", f"{data} line 2", says)
    assert "trained" not in first and not (run / "eval").exists()
