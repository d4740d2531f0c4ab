"""A run dir works from anywhere: made with paths relative to where it started (as the
quickstart does), copied to another folder and used from another working directory,
export, eval, gate, report and --resume give the results the original gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import dump_config, load_config, parse_config
from moetune.config.paths import rebase
from moetune.train import train
from test_train_helpers import one_thread, reverse_rows, save_tiny_model, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore")


def _relative_config(out: str = "runs/r") -> dict:
    return {
        "model": {"id": "model", "dtype": "float32"},
        "lora": {"rank": 4},
        "data": {"train_file": "data/train.jsonl"},
        "output": {"dir": out, "ledger": "runs/ledger.jsonl"},
        "train": {"max_steps": 2, "batch_size": 2, "seq_len": 32, "save_steps": 1,
                  "learning_rate": 1e-2, "device": "cpu"},
        "eval": {"rungs": [{"name": "rev", "kind": "exact_match", "data": "data/eval.jsonl"}]},
    }  # fmt: skip


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("anywhere")
    save_tiny_model(root / "model")
    (root / "data").mkdir()
    write_jsonl(root / "data" / "train.jsonl", reverse_rows(8))
    rows = [{"prompt": r["prompt"], "answer": r["completion"]} for r in reverse_rows(6)]
    write_jsonl(root / "data" / "eval.jsonl", rows)
    return root


def _cli(*args: str) -> tuple[int, dict, str]:
    got = CliRunner().invoke(app, [*args, "--json"])
    return got.exit_code, json.loads(got.stdout) if got.exit_code in (0, 1) else {}, got.stderr


def test_a_copied_run_dir_gives_the_same_results_from_elsewhere(
    work: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(work)
    with one_thread():
        train(parse_config(_relative_config()), progress=False)
    saved = load_config(work / "runs" / "r" / "config.yaml")
    assert Path(saved.data.train_file or "").is_absolute()  # fixed when the run was made
    code, original, err = _cli("eval", "runs/r/config.yaml")
    assert code in (0, 1), err
    copy = Path(shutil.copytree(work / "runs" / "r", tmp_path / "moved" / "r"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    shutil.rmtree(copy / "eval")
    code, again, err = _cli("eval", str(copy / "config.yaml"))
    assert code in (0, 1), err
    assert again["verdict"] == original["verdict"]
    assert [r["candidate_score"] for r in again["rungs"]] == [
        r["candidate_score"] for r in original["rungs"]
    ]
    assert (copy / "eval" / "ladder.json").is_file()  # written into the copy, not the original
    code, gated, err = _cli("gate", str(copy / "eval"))
    assert gated["verdict"] == original["verdict"], err
    code, exported, err = _cli("export", str(copy), "--format", "merged", "--out", "m")
    assert code == 2 and "never promoted" in err  # 6 items: INCONCLUSIVE, so not promoted
    code, exported, err = _cli(
        "export", str(copy), "--format", "merged", "--out", "m", "--unpromoted"
    )
    assert code == 0, err
    assert exported["check"]["passed"] and exported["check"]["items"] == 6
    assert (elsewhere / "m" / "check.json").is_file() and (copy / "exports.json").is_file()
    code, reported, err = _cli("report", str(copy))
    assert code == 0 and Path(reported["report"]).parent == copy, err
    resumed = train(load_config(copy / "config.yaml"), resume=True, progress=False)
    assert Path(resumed.run_dir) == copy  # the copy is resumed, never the original
    weights = "adapter/adapter_model.safetensors"
    assert (copy / weights).read_bytes() == (work / "runs" / "r" / weights).read_bytes()


def test_an_old_run_dir_with_relative_paths_still_resolves(work: Path, tmp_path: Path) -> None:
    old = work / "runs" / "old"
    old.mkdir(parents=True, exist_ok=True)
    (old / "config.yaml").write_text(dump_config(parse_config(_relative_config("runs/old"))))
    cfg = rebase(load_config(old / "config.yaml"), old)  # read from any working directory
    assert cfg.data.train_file == str(work / "data" / "train.jsonl")
    assert cfg.eval.rungs[0].data == str(work / "data" / "eval.jsonl")
    assert cfg.model.id == str(work / "model") and cfg.output.dir == str(old)
    moved = Path(shutil.copytree(work / "runs", tmp_path / "runs"))  # data left behind
    shutil.copytree(work / "data", tmp_path / "data")  # ... or copied along beside it
    cfg = rebase(load_config(moved / "old" / "config.yaml"), moved / "old")
    assert cfg.data.train_file == str(tmp_path / "data" / "train.jsonl")
