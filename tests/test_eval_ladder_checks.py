"""Everything `moetune eval` would refuse in a ladder is refused before the spend: a mistyped
rung kind, a missing rung file, a malformed row, a metric the kind never reads, an lm_eval
rung without a task – by lint (EVAL-LADDER), `moetune data` and `moetune train`, in the
same line, before any run dir is made."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import load_config
from moetune.data.errors import DataError
from moetune.demo.base import SHIPPED_DIR
from moetune.lint.preflight import lint_run
from moetune.train import train

GOOD = [{"prompt": "rev:abc>", "answer": "cba"}, {"prompt": "rev:moe>", "answer": "eom"}]

MISTAKES: list[tuple[str, dict[str, Any], str, str]] = [
    ("kind", {"kind": "exact-match"}, "unknown kind 'exact-match'", "did you mean 'exact_match'"),
    ("file", {"data": "missing.jsonl"}, "eval.rungs[].data of rung 'skill'", "JSONL file"),
    ("row", {"data": "bad.jsonl"}, "bad.jsonl line 2: row needs a non-empty string 'answer'",
     "exact_match rows look like"),
    ("metric", {"metric": "f1"}, "metric 'f1' is not read by exact_match rungs", "lm_eval"),
    ("task", {"kind": "lm_eval", "data": None}, "(lm_eval) names no task", "eval.rungs[].task"),
]  # fmt: skip


def _jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _config(tmp: Path, rung: dict[str, Any]) -> Path:
    train_file = _jsonl(tmp / "train.jsonl", [{"prompt": "rev:ab>", "completion": "ba"}] * 8)
    _jsonl(tmp / "bad.jsonl", [GOOD[0], {"prompt": "rev:x>"}])
    good = _jsonl(tmp / "good.jsonl", GOOD)
    entry = {"name": "skill", "kind": "exact_match", "data": good, **rung}
    entry = {k: str(tmp / v) if k == "data" and v and v != good else v for k, v in entry.items()}
    doc = {
        "model": {"id": str(SHIPPED_DIR), "dtype": "float32"},
        "data": {"train_file": train_file},
        "output": {"dir": str(tmp / "run"), "ledger": str(tmp / "ledger.jsonl")},
        "train": {"device": "cpu", "max_steps": 1, "seq_len": 32},
        "eval": {"rungs": [{k: v for k, v in entry.items() if v is not None}]},
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(("what", "rung", "cause", "fix"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_ladder_mistake_is_caught_before_training(
    tmp_path: Path, what: str, rung: dict[str, Any], cause: str, fix: str
) -> None:
    path = _config(tmp_path, rung)
    cfg = load_config(path)
    findings, _ = lint_run(cfg)
    found = [f for f in findings if f.rule_id == "EVAL-LADDER"]
    assert len(found) == 1 and found[0].severity == "error", findings
    assert cause in found[0].message and fix in found[0].fix
    with pytest.raises(DataError) as err:
        train(cfg, progress=False)
    assert err.value.cause == found[0].message  # the same one line
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written
    got = CliRunner().invoke(app, ["data", str(path)])
    assert got.exit_code == 2 and found[0].message[:60] in " ".join(got.output.split())


def test_a_good_ladder_passes_every_check(tmp_path: Path) -> None:
    cfg = load_config(_config(tmp_path, {}))
    findings, _ = lint_run(cfg)
    assert not [f for f in findings if f.rule_id == "EVAL-LADDER"]
    assert CliRunner().invoke(app, ["data", str(tmp_path / "run.yaml")]).exit_code == 0
