"""The ledger keeps every completed row exactly once, survives torn lines, holds no secret."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest

from moetune.ledger import REDACTED, Ledger, LedgerRow, select


def _row(i: int, writer: int = 0, **kw) -> LedgerRow:
    return LedgerRow(kind="train", status="ok", run_id=f"w{writer}", metrics={"i": i}, **kw)


def test_roundtrip_and_filters(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.jsonl")
    ledger.append(_row(1))
    ledger.append(LedgerRow(kind="eval", status="failed", run_id="w0", reason="OOM"))
    rows = ledger.read().rows
    assert [r.kind for r in rows] == ["train", "eval"]
    assert [r.reason for r in select(rows, status="failed")] == ["OOM"]
    assert select(rows, kind="gate") == []


def test_torn_last_line_is_reported_skipped_and_healed(tmp_path: Path) -> None:
    path = tmp_path / "l.jsonl"
    ledger = Ledger(path)
    ledger.append(_row(1))
    with path.open("ab") as fh:
        fh.write(b'{"id": "abc", "kind": "tr')  # a crash mid-write
    got = ledger.read()
    assert len(got.rows) == 1 and got.problems[0][0] == 2
    ledger.append(_row(2))  # the next row starts on its own line
    got = ledger.read()
    assert [r.metrics["i"] for r in got.rows] == [1, 2]
    assert [n for n, _ in got.problems] == [2]


def test_invalid_row_is_reported_with_its_field(tmp_path: Path) -> None:
    path = tmp_path / "l.jsonl"
    path.write_text(json.dumps({"kind": "train", "status": "exploded"}) + "\n")
    got = Ledger(path).read()
    assert got.rows == [] and "status" in got.problems[0][1]


def test_no_secret_lands_in_a_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planted = "rpa_" + "X7" * 16
    monkeypatch.setenv("RUNPOD_API_KEY", planted)
    hf = "hf_" + "a1B2" * 8
    ledger = Ledger(tmp_path / "l.jsonl")
    ledger.append(
        LedgerRow(
            kind="provision",
            status="infra-failed",
            reason=f"401 for key {planted} while pulling with {hf}",
            metrics={"api_key": "whatever-it-is", "env": {"HF_TOKEN": hf}},
        )
    )
    text = (tmp_path / "l.jsonl").read_text()
    assert planted not in text and hf not in text and "whatever-it-is" not in text
    assert text.count(REDACTED) >= 3


def test_token_counts_are_numbers_not_secrets(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.jsonl")
    metrics = {"tokens": 4096, "tokens_per_s": 812.5, "hf_token": "plain-text-value"}
    ledger.append(LedgerRow(kind="train", status="ok", metrics=metrics))
    (row,) = ledger.read().rows
    assert row.metrics == {"tokens": 4096, "tokens_per_s": 812.5, "hf_token": REDACTED}


def _writer(path: str, writer: int, n: int) -> None:
    ledger = Ledger(path)
    for i in range(n):
        ledger.append(_row(i, writer))


def _lines_of(path: str, run_id: str) -> int:
    try:
        return Path(path).read_text().count(f'"run_id": "{run_id}"')
    except FileNotFoundError:
        return 0


def test_concurrent_writers_and_a_kill_9(tmp_path: Path) -> None:
    path = str(tmp_path / "l.jsonl")
    ctx = mp.get_context("spawn")
    n = 1500
    procs = [ctx.Process(target=_writer, args=(path, w, n)) for w in range(4)]
    for p in procs:
        p.start()
    deadline = time.time() + 60
    while time.time() < deadline and _lines_of(path, "w0") < 100:
        time.sleep(0.05)
    assert procs[0].pid is not None
    os.kill(procs[0].pid, signal.SIGKILL)  # one writer dies mid-way
    for p in procs:
        p.join(timeout=300)
    assert procs[0].exitcode == -signal.SIGKILL
    got = Ledger(path).read()
    by_writer: dict[str, list[int]] = {}
    for row in got.rows:
        assert row.run_id is not None
        by_writer.setdefault(row.run_id, []).append(row.metrics["i"])
    for w in (1, 2, 3):
        assert by_writer[f"w{w}"] == list(range(n))  # every completed row exactly once, in order
    killed = by_writer.get("w0", [])
    assert 100 <= len(killed) < n and killed == list(
        range(len(killed))
    )  # a prefix: nothing duplicated or reordered
    assert len(got.problems) <= 1  # at most the killed writer's torn line


def test_cli_show_and_verify(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from moetune.cli import app

    path = tmp_path / "l.jsonl"
    Ledger(path).append(_row(7))
    Ledger(path).append(LedgerRow(kind="eval", status="failed", reason="timeout"))
    runner = CliRunner()
    shown = runner.invoke(
        app, ["ledger", "show", "--path", str(path), "--status", "failed", "--json"]
    )
    assert shown.exit_code == 0
    assert [r["reason"] for r in json.loads(shown.stdout)["rows"]] == ["timeout"]
    assert runner.invoke(app, ["ledger", "verify", "--path", str(path)]).exit_code == 0
    with path.open("ab") as fh:
        fh.write(b"{torn")
    assert runner.invoke(app, ["ledger", "verify", "--path", str(path)]).exit_code == 1


def test_cli_verify_of_random_bytes_says_what_to_do(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from moetune.cli import app

    path = tmp_path / "l.jsonl"
    path.write_bytes(bytes(range(128, 256)) * 4 + b"\n{torn")  # the sweep's case: no fix said
    for extra in ([], ["--json"]):
        done = CliRunner().invoke(app, ["ledger", "verify", "--path", str(path), *extra])
        assert done.exit_code == 1 and "Traceback" not in done.output
        assert (
            done.stderr.strip() == "fix: reads skip the problem lines; restore them from a "
            "copy of the file (it is git-friendly) or move it aside to start a new ledger"
        )
    doc = json.loads(done.stdout)
    assert (doc["rows"], len(doc["problems"])) == (0, 2) and doc["fix"].startswith("reads skip")


def test_cli_show_refuses_a_status_that_does_not_exist(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from moetune.cli import app

    path = tmp_path / "l.jsonl"
    Ledger(path).append(_row(1))
    got = CliRunner().invoke(app, ["ledger", "show", "--path", str(path), "--status", "weird"])
    assert got.exit_code == 2 and got.stdout == ""
    assert "--status 'weird' is not a ledger status" in got.stderr
    assert "ok, failed, infra-failed, cancelled" in got.stderr


def test_cli_show_takes_only_known_kinds(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from moetune.cli import app

    path = tmp_path / "l.jsonl"
    Ledger(path).append(_row(1))
    show = ["ledger", "show", "--path", str(path), "--json", "--kind"]
    got = CliRunner().invoke(app, [*show, "trian"])  # a typo used to list nothing, silently
    assert got.exit_code == 2, got.output  # --json: the refusal as JSON, and nothing listed
    assert list(json.loads(got.stdout)) == ["error"]
    assert "--kind 'trian' is not a kind of ledger row" in got.stderr
    assert "train, eval, gate, promote, export" in " ".join(got.stderr.split())
    got = CliRunner().invoke(app, [*show, "train"])
    assert got.exit_code == 0 and json.loads(got.stdout)["rows"] != [], got.output
