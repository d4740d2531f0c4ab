"""Rung kinds on the shipped demo base: what each scores per item, their data errors, and
lm-evaluation-harness agreeing with moetune's own multiple-choice scorer."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from moetune.config import RungArgs
from moetune.demo.base import load_base
from moetune.evaluate import RUNG_KINDS, EvalError, make_rung

MC_ITEMS = [
    {"prompt": "copy:abc>", "choices": ["abc", "cba", "aaa"], "answer": 0},
    {"prompt": "rev:abc>", "choices": ["abc", "cba", "aaa"], "answer": "cba"},
    {"prompt": "first:xyz>", "choices": ["z", "x", "y"], "answer": 1},
    {"prompt": "copy:hello>", "choices": ["olleh", "hello"], "answer": 0},  # wrong on purpose
]


@pytest.fixture(scope="module")
def base() -> tuple[Any, Any]:
    return load_base()


def jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def score(rung_args: RungArgs, base: tuple[Any, Any], limit: int | None = None) -> list[Any]:
    rung = make_rung(rung_args)
    return rung.score(*base, rung.load(limit), 8, lambda n: None)


def test_registry_has_the_built_in_kinds() -> None:
    assert {"loss", "exact_match", "contains", "multiple_choice"} <= set(RUNG_KINDS)


def test_multiple_choice_picks_the_likeliest_choice(tmp_path: Path, base: Any) -> None:
    args = RungArgs(name="mc", kind="multiple_choice", data=jsonl(tmp_path / "mc.jsonl", MC_ITEMS))
    got = score(args, base)
    assert [s.score for s in got] == [1.0, 1.0, 1.0, 0.0]
    assert [s.output for s in got] == [0, 1, 1, 1]


def test_exact_match_needs_the_answer_then_stop(tmp_path: Path, base: Any) -> None:
    rows = [{"prompt": "copy:abc>", "answer": "abc"}, {"prompt": "copy:abc>", "answer": "ab"}]
    args = RungArgs(name="em", kind="exact_match", data=jsonl(tmp_path / "em.jsonl", rows))
    got = score(args, base)
    assert [s.score for s in got] == [1.0, 0.0] and got[0].output == "abc"
    assert len(score(args, base, limit=1)) == 1


def test_contains_finds_the_answer_inside_the_output(tmp_path: Path, base: Any) -> None:
    rows = [
        {"prompt": "copy:abcd>", "answer": "bc"},  # inside "abcd": right for contains only
        {"prompt": "copy:abcd>", "answer": "abcd"},
        {"prompt": "copy:abcd>", "answer": "dcba"},
    ]
    path = jsonl(tmp_path / "c.jsonl", rows)
    got = score(RungArgs(name="c", kind="contains", data=path), base)
    assert [s.score for s in got] == [1.0, 1.0, 0.0] and got[0].output == "abcd"
    exact = score(RungArgs(name="e", kind="exact_match", data=path), base)
    assert [s.score for s in exact] == [0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("kind", "row", "problem"),
    [
        ("exact_match", {"prompt": "x"}, "'answer'"),
        ("multiple_choice", {"prompt": "x", "choices": ["a"], "answer": 0}, "at least two"),
        ("multiple_choice", {"prompt": "x", "choices": ["a", "b"], "answer": 5}, "'answer'"),
        ("loss", {"prompt": "x"}, "'completion'"),
        ("loss", ["not", "an", "object"], "not a JSON object"),
    ],
)
def test_bad_rows_name_the_file_and_line(tmp_path: Path, kind: str, row: Any, problem: str) -> None:
    good = {"text": "ab"} if kind == "loss" else MC_ITEMS[0]
    good = {"prompt": "a", "answer": "b"} if kind == "exact_match" else good
    path = jsonl(tmp_path / "d.jsonl", [good, row])
    with pytest.raises(EvalError) as err:
        make_rung(RungArgs(name="r", kind=kind, data=path)).load(None)
    assert "d.jsonl line 2: row" in err.value.cause
    assert problem in err.value.cause and err.value.fix


def test_unknown_kind_and_missing_data(tmp_path: Path) -> None:
    with pytest.raises(EvalError, match="unknown kind 'bleu'") as err:
        make_rung(RungArgs(name="r", kind="bleu"))
    assert "exact_match" in err.value.fix
    with pytest.raises(EvalError, match="no data file"):
        make_rung(RungArgs(name="r", kind="loss")).load(None)
    with pytest.raises(EvalError, match="not found"):
        make_rung(RungArgs(name="r", kind="loss", data=str(tmp_path / "none.jsonl"))).load(None)


@pytest.mark.parametrize("content", [None, "", "dir"])
def test_a_missing_or_empty_rung_file_names_the_rung_field_not_train_data(
    tmp_path: Path, content: str | None
) -> None:
    path = tmp_path / "eval-dup.jsonl"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(EvalError) as err:
        make_rung(RungArgs(name="dup", kind="exact_match", data=str(path))).load(None)
    said = {None: "not found", "": "is empty", "dir": "is a directory"}[content]
    assert (
        err.value.cause.startswith("eval.rungs[].data of rung 'dup': ") and said in err.value.cause
    )
    assert str(path) in err.value.cause and "train_file" not in str(err.value)
    assert err.value.fix.startswith("point eval.rungs[].data of rung 'dup' at a JSONL file")


def test_lm_eval_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    with pytest.raises(EvalError, match="lm-evaluation-harness") as err:
        make_rung(RungArgs(name="h", kind="lm_eval", task="t")).load(None)
    assert "moetune[lmeval]" in err.value.fix


def test_lm_eval_task_agrees_with_multiple_choice(
    tmp_path: Path, base: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    # answers as indices: what lm-eval's doc_to_target expects
    data = jsonl(tmp_path / "items.jsonl", [MC_ITEMS[0], MC_ITEMS[2], MC_ITEMS[3]])
    task = {
        "task": "moetune_demo_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": data}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{prompt}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "target_delimiter": "",
        "metric_list": [{"metric": "acc"}],
    }
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "demo_mc.yaml").write_text(json.dumps(task))
    harness = RungArgs(
        name="h", kind="lm_eval", task="moetune_demo_mc", include_path=str(tmp_path / "tasks")
    )
    ours = RungArgs(name="mc", kind="multiple_choice", data=data)
    assert [s.score for s in score(harness, base)] == [s.score for s in score(ours, base)]
    assert [s.score for s in score(harness, base)] == [1.0, 1.0, 0.0]
    with pytest.raises(EvalError, match="no metric 'f1'"):
        score(harness.model_copy(update={"metric": "f1"}), base)
