"""The gate trusts no results dir it did not check: per-item files must hold exactly the
ladder's item ids, once each, with finite scores; eval refuses counts that would drop items
or crash; `--overwrite` replaces moetune's own files only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from moetune.demo.skills import make_items, write_jsonl
from moetune.evaluate import gate_results
from moetune.evaluate.results import id_problem, owned_files
from moetune.ledger import Ledger
from test_evaluate_ladder import invoke, save_adapter, write_config

N = 20


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One real eval: the shipped base vs an adapter that changes nothing, on N items."""
    root = tmp_path_factory.mktemp("evaluated")
    rows = [{"prompt": it.prompt, "answer": it.answer} for it in make_items(["copy"], N, 0, "eval")]
    data = write_jsonl(root / "copy.jsonl", rows)
    rung = {"name": "copy", "kind": "exact_match", "role": "protected", "data": str(data)}
    config = write_config(root, {}, [rung])
    adapter = save_adapter(root / "adapter", 0.0)
    out = invoke("eval", str(config), "--adapter", str(adapter), "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["verdict"] == "GO"
    return {"config": config, "adapter": adapter, "results": root / "run" / "eval"}


def copy_results(evaluated: dict[str, Path], tmp: Path) -> Path:
    return Path(shutil.copytree(evaluated["results"], tmp / "eval"))


def items_path(results: Path) -> Path:
    return results / "rungs" / "copy.items.jsonl"


def rewrite_items(results: Path, edit: Any) -> None:
    rows = [json.loads(line) for line in items_path(results).read_text().splitlines()]
    items_path(results).write_text("".join(json.dumps(r) + "\n" for r in edit(rows)))


def assert_refused(results: Path, *needles: str) -> None:
    """The gate exits 2 with one line naming the cause and the fix; verdict.json unchanged."""
    before = (results / "verdict.json").read_bytes()
    out = invoke("gate", str(results))
    assert out.exit_code == 2, out.output
    lines = [line for line in out.output.strip().splitlines() if line.strip()]
    assert len(lines) <= 2 and "Traceback" not in out.output, out.output
    for needle in (*needles, "fix:"):
        assert needle in " ".join(lines), out.output
    assert (results / "verdict.json").read_bytes() == before


def test_gate_refuses_duplicated_items(evaluated: dict[str, Path], tmp_path: Path) -> None:
    results = copy_results(evaluated, tmp_path)
    rewrite_items(results, lambda rows: [r for r in rows for _ in range(3)])
    assert_refused(results, "scores item 0 3 times")


def test_gate_refuses_shifted_ids(evaluated: dict[str, Path], tmp_path: Path) -> None:
    results = copy_results(evaluated, tmp_path)
    rewrite_items(results, lambda rows: [{**r, "i": r["i"] + 1} for r in rows])
    assert_refused(results, f"outside the ladder's 0..{N - 1}: {N}")


def test_gate_refuses_missing_rows(evaluated: dict[str, Path], tmp_path: Path) -> None:
    results = copy_results(evaluated, tmp_path)
    rewrite_items(results, lambda rows: rows[: N // 2])
    assert_refused(results, f"holds {N // 2} of the ladder's {N} items")


def test_gate_refuses_non_finite_or_missing_scores(
    evaluated: dict[str, Path], tmp_path: Path
) -> None:
    results = copy_results(evaluated, tmp_path)
    rewrite_items(results, lambda rows: [{**rows[0], "candidate": float("nan")}, *rows[1:]])
    assert_refused(results, "copy.items.jsonl", "finite")
    rewrite_items(results, lambda rows: [{"i": 0, "base": 1.0}, *rows[1:]])
    assert_refused(results, "candidate")


def test_gate_refuses_unreadable_ladder(evaluated: dict[str, Path], tmp_path: Path) -> None:
    results = copy_results(evaluated, tmp_path)
    ladder = results / "ladder.json"
    doc = json.loads(ladder.read_text())
    ladder.write_text(json.dumps({**doc, "rungs": [{**doc["rungs"][0], "n": "many"}]}))
    assert_refused(results, "not a moetune ladder", "rungs.0.n")
    ladder.write_bytes(b"\xff\xfe\x00{")
    assert_refused(results, "cannot read", "ladder.json")
    ladder.write_text(json.dumps({**doc, "rungs": [{**doc["rungs"][0], "items_file": "../x"}]}))
    assert_refused(results, "points outside")


def test_untouched_results_still_gate_go(evaluated: dict[str, Path], tmp_path: Path) -> None:
    doc = gate_results(copy_results(evaluated, tmp_path), ledger=tmp_path / "ledger.jsonl")
    assert doc["verdict"] == "GO" and doc["rungs"][0]["n"] == N


def test_id_problem_accepts_any_order_and_names_the_first_problem() -> None:
    assert id_problem([2, 0, 1], 3) is None
    assert id_problem([0, 1, 1, 2], 3) == "scores item 1 2 times (repeated ids: 1)"
    assert id_problem([0, 1, 7], 3) == "has ids outside the ladder's 0..2: 7"
    assert id_problem(list(range(2, 10)), 10) == (
        "holds 8 of the ladder's 10 items (missing ids: 0, 1)"
    )
    assert id_problem([0, 1], 10**15) == (  # an edited n is answered at once, not enumerated
        f"holds 2 of the ladder's {10**15} items (missing ids: 2, 3, 4, 5, 6 and {10**15 - 7} more)"
    )


# ---------------------------------------------------------------- eval's counts


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--limit", "-1"), "--limit / eval.limit -1 is not a positive number"),
        (("--limit", "0"), "--limit / eval.limit 0 is not a positive number"),
        # run.yaml fields are refused by the config itself, naming the field
        (("--set", "eval.batch_size=0"), "eval.batch_size: must be a positive integer"),
        (("--set", "eval.limit=-3"), "eval.limit: must be"),
    ],
    ids=["limit-negative", "limit-zero", "batch-size-zero", "config-limit-negative"],
)
def test_eval_counts_refused_before_scoring(
    evaluated: dict[str, Path], tmp_path: Path, args: tuple[str, ...], needle: str
) -> None:
    rung = json.loads((evaluated["results"] / "ladder.json").read_text())["rungs"][0]["args"]
    config = write_config(tmp_path, {}, [rung])
    out = invoke("eval", str(config), "--adapter", str(evaluated["adapter"]), *args)
    assert out.exit_code == 2 and needle in out.output and "fix:" in out.output, out.output
    assert "Traceback" not in out.output
    assert not (tmp_path / "run").exists()  # nothing scored, nothing written
    rows = Ledger(tmp_path / "ledger.jsonl").read().rows
    # an option eval refuses is a failed attempt; a run.yaml the config refuses is no attempt
    attempted = [("eval", "failed")] if args[0] == "--limit" else []
    assert [(r.kind, r.status) for r in rows] == attempted


def test_eval_limit_negative_refused(evaluated: dict[str, Path], tmp_path: Path) -> None:
    """`--limit -1` used to score all items but the last; it is refused instead."""
    from moetune.config import load_config
    from moetune.evaluate import EvalError, run_eval

    rung = json.loads((evaluated["results"] / "ladder.json").read_text())["rungs"][0]["args"]
    cfg = load_config(write_config(tmp_path, {}, [rung]))
    with pytest.raises(EvalError, match="not a positive number of items"):
        run_eval(cfg, evaluated["adapter"], limit=-1, progress=False)


# ---------------------------------------------------------------- --overwrite


def test_overwrite_replaces_only_moetunes_files(evaluated: dict[str, Path], tmp_path: Path) -> None:
    results = copy_results(evaluated, tmp_path)
    (results / "notes.md").write_text("mine")
    (results / "rungs" / "mine.txt").write_text("mine too")
    (results / "rungs" / "old-rung.items.jsonl").write_text("")  # not in this ladder: kept
    old_ladder = json.loads((results / "ladder.json").read_text())
    cfg = yaml_with(evaluated["config"], tmp_path, results)
    args = ("eval", str(cfg), "--adapter", str(evaluated["adapter"]), "--limit", "3")
    refused = invoke(*args)
    assert refused.exit_code == 2 and "--overwrite" in refused.output
    assert json.loads((results / "ladder.json").read_text()) == old_ladder
    out = invoke(*args, "--overwrite", "--json")
    assert out.exit_code == 1, out.output  # 3 items: INCONCLUSIVE (exit 1 unless GO)
    assert json.loads((results / "ladder.json").read_text())["rungs"][0]["n"] == 3
    assert len(items_path(results).read_text().splitlines()) == 3
    assert (results / "notes.md").read_text() == "mine"
    assert (results / "rungs" / "mine.txt").read_text() == "mine too"
    assert (results / "rungs" / "old-rung.items.jsonl").exists()
    assert not list(tmp_path.glob(".eval.tmp*"))  # no staging dir left behind
    assert {p.name for p in owned_files(results)} == {
        "ladder.json", "verdict.json", "copy.json", "copy.items.jsonl",
    }  # fmt: skip


def test_a_folder_of_user_files_is_not_results(evaluated: dict[str, Path], tmp_path: Path) -> None:
    results = tmp_path / "eval"
    results.mkdir()
    (results / "notes.md").write_text("mine")
    cfg = yaml_with(evaluated["config"], tmp_path, results)
    out = invoke("eval", str(cfg), "--adapter", str(evaluated["adapter"]), "--limit", "2")
    assert out.exit_code == 1, out.output  # nothing of moetune's there: no --overwrite needed
    assert "INCONCLUSIVE" in out.output  # 2 items decide nothing: exit 1, as `gate`
    assert (results / "notes.md").read_text() == "mine" and (results / "ladder.json").is_file()


def yaml_with(config: Path, tmp: Path, results: Path) -> Path:
    """The evaluated config, writing its results to `results` and its ledger under `tmp`."""
    import yaml

    doc = yaml.safe_load(config.read_text())
    doc["eval"]["results_dir"] = str(results)
    doc["output"] = {"dir": str(tmp / "run"), "ledger": str(tmp / "ledger.jsonl")}
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_results_dir_that_is_a_file_is_refused_before_scoring(
    evaluated: dict[str, Path], tmp_path: Path
) -> None:
    blocker = tmp_path / "eval"
    blocker.write_text("a file of the user's")
    cfg = yaml_with(evaluated["config"], tmp_path, blocker)
    out = invoke("eval", str(cfg), "--adapter", str(evaluated["adapter"]))
    assert out.exit_code == 2 and "is a file" in out.output and "Traceback" not in out.output
    assert blocker.read_text() == "a file of the user's"
