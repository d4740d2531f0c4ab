"""Property tests over everything a user hands moetune – run.yaml bytes, `--set` strings,
training data rows, per-item eval results, ledger lines: each case either works or is
refused with one line (a MoetuneError in-process, exit 2 on the CLI), never a traceback, and
nothing is left half-written (no temp files, the user's files unchanged).

Examples per test stay small for the fast suite; MOETUNE_FUZZ_EXAMPLES=2000 digs deeper."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import RungArgs, dump_config, load_config, parse_config
from moetune.data import read_checked
from moetune.errors import MoetuneError
from moetune.evaluate import gate_results
from moetune.ledger import Ledger, LedgerRow

EXAMPLES = int(os.environ.get("MOETUNE_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(FUZZ, max_examples=max(EXAMPLES // 2, 10))  # examples that write and fsync files
runner = CliRunner()


@contextmanager
def workdir() -> Iterator[Path]:
    """A fresh folder per example (pytest's tmp_path is one per test, not per example)."""
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def assert_one_line(err: MoetuneError) -> None:
    assert "\n" not in err.cause and "\n" not in err.fix, repr(err)
    assert err.cause and err.fix, repr(err)  # every refusal says what to do


def assert_cli_refused_or_ok(result: Any, *ok: int) -> None:
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code in (*ok, 2), result.output
    if result.exit_code == 2:  # one line on stderr; with --json, one error object on stdout
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        assert len(lines) == 1 and "error:" in lines[0], result.output
        if result.stdout.strip():
            assert json.loads(result.stdout)["error"]["exit_code"] == 2, result.stdout


# ---------------------------------------------------------------- run.yaml and --set

SECTIONS = ["model", "lora", "data", "output", "train", "hardware", "lane", "eval"]
FIELDS = ["id", "rank", "targets", "seq_len", "batch_size", "limit", "rungs", "dir", "dtype"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12)
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3), max_leaves=6)
sections = st.dictionaries(
    st.one_of(st.sampled_from(SECTIONS), st.text(max_size=6)),
    st.one_of(values, st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5), values)),
    max_size=4,
)
run_yaml = st.one_of(
    st.binary(max_size=120),
    st.text(max_size=120).map(str.encode),
    sections.map(lambda d: yaml.safe_dump(d, allow_unicode=True).encode()),
)


def load_or_refuse(path: Path, overrides: list[str] | None = None) -> Any:
    try:
        return load_config(path, overrides)
    except MoetuneError as err:
        assert_one_line(err)
        return None


@FUZZ
@given(content=run_yaml)
def test_run_yaml_loads_or_is_refused_in_one_line(content: bytes) -> None:
    with workdir() as tmp:
        path = tmp / "run.yaml"
        path.write_bytes(content)
        cfg = load_or_refuse(path)
        if cfg is not None:  # what loads round-trips through the resolved copy a run saves
            assert parse_config(yaml.safe_load(dump_config(cfg))) == cfg
        assert path.read_bytes() == content and [p.name for p in tmp.iterdir()] == ["run.yaml"]


set_strings = st.one_of(
    st.text(max_size=40),
    st.tuples(
        st.sampled_from([f"{s}.{f}" for s in SECTIONS for f in FIELDS] + ["lora.targets", ""]),
        st.sampled_from(["=", "==", ""]),
        st.text(alphabet="[]{},:'\"-0123456789abc .\\\n\t", max_size=16),
    ).map("".join),
)


@FUZZ
@given(assignment=set_strings)
def test_set_strings_apply_or_are_refused_in_one_line(assignment: str) -> None:
    try:
        cfg = parse_config({}, [assignment])
    except MoetuneError as err:
        assert_one_line(err)
        return
    key, _, raw = assignment.partition("=")
    if key.strip() == "train.seq_len":  # an accepted value is the value given
        assert cfg.train.seq_len == yaml.safe_load(raw)


@FEW
@given(content=run_yaml, assignment=set_strings)
def test_cli_with_any_run_yaml_and_set_exits_2_in_one_line(content: bytes, assignment: str) -> None:
    """Through the CLI's guard: `eval` reads the config and --set, then stops at the empty
    ladder forced last (the ledger pinned to the temp dir, so nothing lands elsewhere)."""
    with workdir() as tmp:
        path = tmp / "run.yaml"
        path.write_bytes(content)
        pinned = ["--set", f"output.ledger={tmp / 'l.jsonl'}", "--set", "eval.rungs=[]"]
        result = runner.invoke(app, ["eval", str(path), "--set", assignment, *pinned])
        assert_cli_refused_or_ok(result)  # never 0: the ladder is empty
        assert path.read_bytes() == content
        assert {p.name for p in tmp.iterdir()} <= {"run.yaml", "l.jsonl", "l.jsonl.lock"}


# ---------------------------------------------------------------- training data rows

roles = st.sampled_from(["user", "assistant", "system", "tool", "robot", 3])
message = st.fixed_dictionaries(
    {"role": roles, "content": st.one_of(st.text(max_size=8), st.none())}
)
field_value = st.one_of(st.text(max_size=8), st.lists(message, max_size=3), scalars)
data_row = st.one_of(
    st.dictionaries(
        st.sampled_from(["messages", "prompt", "completion", "text", "answer"])
        | st.text(max_size=4),
        field_value,
        max_size=3,
    ),
    values,
)
data_line = st.one_of(data_row.map(json.dumps), st.text(max_size=20))


@FUZZ
@given(lines=st.lists(data_line, max_size=6), suffix=st.sampled_from([".jsonl", ".json", ".txt"]))
def test_data_rows_check_or_are_refused_in_one_line(lines: list[str], suffix: str) -> None:
    with workdir() as tmp:
        path = tmp / f"train{suffix}"
        path.write_text("\n".join(lines), encoding="utf-8")
        before = path.read_bytes()
        try:
            fmt, rows = read_checked(path)
        except MoetuneError as err:
            assert_one_line(err)
            assert str(path) in err.cause  # the refusal names the file (and the line)
            return
        finally:
            assert path.read_bytes() == before and len(list(tmp.iterdir())) == 1
        assert rows and all(set(row) == set(fmt.keys) for _, row in rows)


item_value = st.one_of(st.text(max_size=6), st.lists(st.text(max_size=4), max_size=3), scalars)
eval_item = st.dictionaries(
    st.sampled_from(["prompt", "answer", "choices", "text", "completion"]), item_value, max_size=4
)
eval_line = st.one_of(eval_item.map(json.dumps), data_line)


@FUZZ
@given(
    lines=st.lists(eval_line, max_size=5),
    kind=st.sampled_from(["loss", "exact_match", "multiple_choice"]),
    limit=st.one_of(st.none(), st.integers(1, 3)),
)
def test_eval_items_load_or_are_refused_in_one_line(
    lines: list[str], kind: str, limit: int | None
) -> None:
    from moetune.evaluate import make_rung

    with workdir() as tmp:
        path = tmp / "items.jsonl"
        path.write_text("\n".join(lines), encoding="utf-8")
        rung = make_rung(RungArgs(name="r", kind=kind, data=str(path)))
        try:
            items = rung.load(limit)
        except MoetuneError as err:
            assert_one_line(err)
            assert "rung 'r'" in err.cause  # the refusal names the rung
            return
        assert items and len(items) <= (limit or len(items))
        assert all(isinstance(item, dict) for item in items)


def test_data_row_refusal_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "ok"}\n{"prompt": "a", "completion": "b"}\n')
    with pytest.raises(MoetuneError, match=r"line 3: a prompt/completion row in a text file"):
        read_checked(path)
    path.write_bytes(b'{"text": "ok"}\n\xff\xfe{"text": 1}\n')
    with pytest.raises(MoetuneError, match="not UTF-8"):
        read_checked(path)


# ---------------------------------------------------------------- per-item eval results


def write_results(root: Path, rows: list[Any] | bytes, n: int) -> Path:
    """A results dir as `moetune eval` writes it, with the per-item file given."""
    results = root / "eval"
    (results / "rungs").mkdir(parents=True)
    args = RungArgs(name="r", kind="exact_match", role="protected").model_dump(mode="json")
    ladder = {
        "rungs": [{"name": "r", "unit": "accuracy", "n": n, "items_file": "rungs/r.items.jsonl",
                   "args": args}],
        "gate": {"alpha": 0.05}, "adapter": "a", "adapter_sha256": "b",
        "ledger": str(root / "l.jsonl"),
    }  # fmt: skip
    (results / "ladder.json").write_text(json.dumps(ladder))
    body = rows if isinstance(rows, bytes) else "".join(json.dumps(r) + "\n" for r in rows).encode()
    (results / "rungs" / "r.items.jsonl").write_bytes(body)
    return results


score = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(), st.integers(-3, 3), st.text(max_size=2))
item = st.fixed_dictionaries(
    {"i": st.one_of(st.integers(-2, 12), st.text(max_size=2)), "base": score, "candidate": score}
)
item_file = st.one_of(
    st.lists(item, max_size=12), st.lists(data_row, max_size=4), st.binary(max_size=40)
)


@FUZZ
@given(rows=item_file, n=st.integers(1, 10))
def test_gate_decides_only_on_exactly_the_ladders_items(rows: list[Any] | bytes, n: int) -> None:
    with workdir() as tmp:
        results = write_results(tmp, rows, n)
        before = sorted(p.name for p in results.rglob("*"))
        args = ["gate", str(results), "--ledger", str(tmp / "l.jsonl"), "--json"]
        result = runner.invoke(app, args)
        assert_cli_refused_or_ok(result, 0, 1)  # GO, NO-GO / INCONCLUSIVE, or refused
        if result.exit_code == 2:
            assert not (results / "verdict.json").exists()  # a refusal writes no verdict
            assert sorted(p.name for p in results.rglob("*")) == before
            return
        assert isinstance(rows, list)  # decided: the file held each id 0..n-1 exactly once
        assert sorted(r["i"] for r in rows) == list(range(n))
        assert all(math.isfinite(float(r[k])) for r in rows for k in ("base", "candidate"))
        doc = json.loads(result.stdout)
        assert doc["rungs"][0]["n"] == n and (doc["verdict"] == "GO") == (result.exit_code == 0)
        assert json.loads((results / "verdict.json").read_text())["hash"] == doc["hash"]
        assert not [p for p in tmp.rglob("*") if p.name.endswith(".tmp")]  # no temp file left


@FEW
@given(
    scores=st.lists(
        st.tuples(st.sampled_from([0.0, 1.0]), st.sampled_from([0.0, 1.0])), min_size=1, max_size=30
    ),
    order=st.randoms(use_true_random=False),
)
def test_gate_verdict_does_not_depend_on_row_order(
    scores: list[tuple[float, float]], order: Any
) -> None:
    rows = [{"i": i, "base": b, "candidate": c} for i, (b, c) in enumerate(scores)]
    shuffled = rows[:]
    order.shuffle(shuffled)
    with workdir() as a, workdir() as b:
        first = gate_results(write_results(a, rows, len(rows)), ledger=a / "l.jsonl")
        second = gate_results(write_results(b, shuffled, len(rows)), ledger=b / "l.jsonl")
    assert first["rungs"] == second["rungs"] and first["verdict"] == second["verdict"]


# ---------------------------------------------------------------- ledger lines

valid_row = st.builds(
    lambda kind, status: LedgerRow(kind=kind, status=status).model_dump_json().encode(),
    st.text(min_size=1, max_size=6),
    st.sampled_from(["ok", "failed", "infra-failed", "cancelled"]),
)
ledger_line = st.one_of(
    valid_row, st.binary(max_size=30), data_row.map(lambda r: json.dumps(r).encode())
)


@FUZZ
@given(lines=st.lists(ledger_line, max_size=8))
def test_ledger_reads_any_bytes_and_keeps_appending(lines: list[bytes]) -> None:
    with workdir() as tmp:
        path = tmp / "ledger.jsonl"
        path.write_bytes(b"\n".join(lines))
        got = Ledger(path).read()
        assert len(got.rows) + len(got.problems) == sum(
            1 for x in path.read_bytes().splitlines() if x.strip()
        )
        for _, problem in got.problems:
            assert "\n" not in problem
        verify = runner.invoke(app, ["ledger", "verify", "--path", str(path)])
        assert verify.exit_code == (1 if got.problems else 0) and "Traceback" not in verify.output
        appended = Ledger(path).append(LedgerRow(kind="train", status="ok"))
        assert Ledger(path).read().rows[-1] == appended  # a torn tail never swallows a row


def test_ledger_line_that_is_not_utf8_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    row = LedgerRow(kind="eval", status="ok").model_dump_json().encode()
    path.write_bytes(row + b"\n\xff\xfe\x00garbage\n" + row + b"\n")
    got = Ledger(path).read()
    assert len(got.rows) == 2 and got.problems == [(2, "not UTF-8 text (byte 0); a foreign write?")]
    out = runner.invoke(app, ["ledger", "show", "--path", str(path)])
    assert out.exit_code == 0 and "line 2 skipped" in out.output


def test_ledger_path_that_is_a_directory(tmp_path: Path) -> None:
    for command in ("show", "verify"):
        out = runner.invoke(app, ["ledger", command, "--path", str(tmp_path)])
        assert_cli_refused_or_ok(out)
        assert out.exit_code == 2 and "is a directory" in out.output


def test_ledger_verify_on_a_missing_file(tmp_path: Path) -> None:
    out = runner.invoke(app, ["ledger", "verify", "--path", str(tmp_path / "none.jsonl")])
    assert_cli_refused_or_ok(out)
    assert out.exit_code == 2 and "no ledger at" in out.output
    assert not (tmp_path / "none.jsonl").exists()


def test_train_overwrite_refuses_a_promoted_adapter_on_the_cli(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    (run / "summary.json").write_text("{}")
    (run / "adapter" / "PROMOTED").write_text("{}")
    config = tmp_path / "run.yaml"
    out = {"dir": str(run), "ledger": str(tmp_path / "l")}
    config.write_text(yaml.safe_dump({"model": {"id": "Qwen/Qwen3-30B-A3B"}, "output": out}))
    out = runner.invoke(app, ["train", str(config), "--overwrite"])
    assert_cli_refused_or_ok(out)
    assert out.exit_code == 2 and "--overwrite-promoted" in out.output
    assert sorted(p.name for p in run.rglob("*")) == [
        "PROMOTED",
        "adapter",
        "config.yaml",
        "summary.json",
    ]


def test_a_ledger_that_is_a_directory_is_refused_before_any_work(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    output = {"dir": str(tmp_path / "run"), "ledger": str(tmp_path)}
    config.write_text(yaml.safe_dump({"model": {"id": "Qwen/Qwen3-30B-A3B"}, "output": output}))
    out = runner.invoke(app, ["eval", str(config)])
    assert_cli_refused_or_ok(out)
    assert "is a directory" in out.output and not (tmp_path / "run").exists()
