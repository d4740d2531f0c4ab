"""Bad data is refused in one line that names the source, the row and the fix – before any
model is built, with nothing written: missing columns, empty assistant turns (SFT and DPO),
wrong roles, non-UTF-8 lines, sources that do not exist, weights ≤ 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import moetune.demo
from moetune.cli import app
from moetune.config import DataArgs, parse_config
from moetune.data import check_sources
from moetune.data.errors import DataError
from moetune.errors import ConfigError
from test_train_helpers import reverse_rows, write_jsonl

SFT = ("messages", "prompt/completion", "text")


def _refused(allowed=SFT, **data) -> DataError:
    with pytest.raises(DataError) as info:
        check_sources(DataArgs(**data), allowed)
    err = info.value
    assert "\n" not in str(err) and err.fix
    return err


def _chat(reply: str, role: str = "assistant") -> dict:
    return {"messages": [{"role": "user", "content": "rev:ab"}, {"role": role, "content": reply}]}


def test_a_mapped_column_a_row_lacks(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"q": "a>", "a": "b"}, {"q": "c>"}])
    err = _refused(sources=[{"path": str(path), "columns": {"prompt": "q", "completion": "a"}}])
    assert f"{path} line 2: missing column 'a'" in err.cause


def test_an_empty_assistant_turn_sft_and_dpo(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [_chat("ba"), _chat("  ")])
    err = _refused(train_file=str(path))
    assert f"{path} line 2" in err.cause and "turn 2 is an empty assistant turn" in err.cause
    pref = [{"prompt": "p", "chosen": c, "rejected": "b"} for c in ("a", "")]
    path = write_jsonl(tmp_path / "p.jsonl", pref)
    err = _refused(("preference",), train_file=str(path))
    assert f"{path} line 2: 'chosen' is empty" in err.cause


def test_a_wrong_role_and_a_sharegpt_speaker(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [_chat("ba"), _chat("ba", role="bot")])
    assert "line 2: 'messages' turn 2 has role 'bot'" in _refused(train_file=str(path)).cause
    share = [{"conversations": [{"from": "human", "value": "a"}, {"from": "robot", "value": "b"}]}]
    path = write_jsonl(tmp_path / "s.jsonl", share)
    assert "line 1: conversations turn 2 is from 'robot'" in _refused(train_file=str(path)).cause


def test_a_non_utf8_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    err = _refused(train_file=str(path))
    assert str(path) in err.cause and "not UTF-8" in err.cause


def test_sources_that_do_not_exist_and_a_directory_that_is_not_data(tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert "not found" in _refused(train_file=str(missing)).cause
    err = _refused(sources=[{"path": "nobody-here/no-such-set"}])  # the hub is offline here
    assert "'nobody-here/no-such-set'" in err.cause and "not found" in err.cause
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("no data here")
    err = _refused(sources=[{"path": str(tmp_path / "empty")}])
    assert "not found" not in err.cause and str(tmp_path / "empty") in err.cause


def test_random_bytes_under_a_csv_name_are_one_line_exit_2(tmp_path):
    data = tmp_path / "train.csv"  # datasets' DatasetGenerationError was exit 3 "unexpected"
    data.write_bytes(bytes(range(128, 256)) * 16)
    run = tmp_path / "run.yaml"
    base = Path(moetune.demo.__file__).parent / "base_model"  # a tokenizer on disk
    run.write_text(json.dumps({"model": {"id": str(base)}, "data": {"train_file": str(data)}}))
    result = CliRunner().invoke(app, ["data", str(run), "--json"])
    assert result.exit_code == 2, result.output
    said = result.stderr.strip().splitlines()[-1]
    assert f"source {data}: cannot be read (" in said and "codec can't decode" in said
    assert "fix: check the files are valid json / parquet / csv" in said
    assert "Traceback" not in result.output and "unexpected" not in result.output


def test_a_weight_of_zero_or_less_names_the_source():
    for weight in (0, -1.5, float("nan")):
        with pytest.raises(ConfigError) as info:
            parse_config({"data": {"sources": [{"path": "a.jsonl", "weight": weight}]}})
        assert "data.sources.0" in info.value.cause and "'a.jsonl'" in info.value.cause


def test_train_refuses_bad_data_before_a_model_is_built(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [*reverse_rows(2), {"prompt": "x>", "completion": ""}])
    run = tmp_path / "run.yaml"
    out = tmp_path / "out"
    cfg = {"model": {"id": str(tmp_path / "no-model-here")}, "data": {"train_file": str(data)},
           "output": {"dir": str(out), "ledger": str(tmp_path / "l.jsonl")}}  # fmt: skip
    run.write_text(json.dumps(cfg))  # YAML reads JSON
    result = CliRunner().invoke(app, ["train", str(run)])
    assert result.exit_code == 2, result.output
    assert f"{data} line 3: 'completion' is empty" in result.output
    assert "Traceback" not in result.output and not out.exists()
