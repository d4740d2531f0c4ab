"""`moetune push` against a local stand-in for the Hub (tests/fake_hub.py): a really trained
tiny run, promoted by the real `promote`, goes up in one commit with a model card that
huggingface_hub's own ModelCard parses; an unpromoted or NO-GO adapter is refused without
--unpromoted; the token never shows (a sentinel token is searched for in every output)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import ModelCard, constants
from typer.testing import CliRunner

from fake_hub import FakeHub
from moetune.cli import app
from moetune.evaluate import promote
from moetune.evaluate.gate import verdict_hash
from moetune.io import adapter_digest
from moetune.report.card import model_card
from moetune.report.html import load_inputs
from moetune.train import train
from test_train_helpers import one_thread, reverse_rows, run_config, save_tiny_model, write_jsonl

TOKEN = "sentinel-push-token-7f3a9c41"  # no credential shape: no masker would hide it
RUNGS = [("reverse-words", "target", 0.52), ("copy-skill", "protected", -0.02)]


def _verdict(adapter: Path, verdict: str) -> dict[str, Any]:
    rungs = [
        {"name": name, "role": role, "status": "pass", "delta": delta, "se_delta": 0.03,
         "z": 2.24, "lower": delta - 0.07, "upper": delta + 0.07, "threshold": -0.1, "n": 200,
         "n_needed": None, "base_score": 0.5, "candidate_score": 0.5 + delta,
         "reason": f"{name}: lower bound clears its threshold"}
        for name, role, delta in RUNGS
    ]  # fmt: skip
    doc = {"verdict": verdict, "alpha": 0.05, "reason": "the target improved", "rungs": rungs,
           "adapter": str(adapter), "adapter_sha256": adapter_digest(adapter)}  # fmt: skip
    return {**doc, "hash": verdict_hash(doc)}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run trained for real (2 steps), gated GO and promoted as `gate --promote` does."""
    root = tmp_path_factory.mktemp("push")
    model = save_tiny_model(root / "model")
    data = write_jsonl(root / "reverse.jsonl", reverse_rows(16))
    with one_thread():
        train(run_config(model, data, root / "run", max_steps=2), progress=False)
    run = root / "run"
    results = run / "eval"
    results.mkdir()
    (results / "ladder.json").write_text(json.dumps({"ledger": str(root / "ledger.jsonl")}))
    (results / "verdict.json").write_text(json.dumps(_verdict(run / "adapter", "GO")))
    promote(results, adapter=run / "adapter")  # the ladder.json here is a stand-in
    return run


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    server = FakeHub(TOKEN).start()
    yield server
    server.stop()


def _push(hub: FakeHub, run: Path, *args: str, token: str | None = TOKEN) -> Any:
    offline = ("HF_", "HUGGING", "TRANSFORMERS_OFFLINE")  # the hub client honours all three
    env = {k: v for k, v in os.environ.items() if not k.startswith(offline)}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(run.parent / "hf-home"))
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    if token:
        env["HF_TOKEN"] = token
    cmd = [sys.executable, "-m", "moetune", "push", str(run), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert TOKEN not in done.stdout + done.stderr
    return done


def _ledger(run: Path) -> list[dict[str, Any]]:
    text = (run.parent / "ledger.jsonl").read_text()
    assert TOKEN not in text
    return [r for r in map(json.loads, text.splitlines()) if r["kind"] == "push"]


def _push_here(
    hub: FakeHub, run: Path, monkeypatch: pytest.MonkeyPatch, *args: str, token: str = TOKEN
) -> Any:
    """The same command in this process (cheaper than a subprocess): the hub client's
    endpoint, offline switch and token path pointed here as the environment would."""
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(run.parent / "no-token"))
    monkeypatch.setenv("HF_TOKEN", token)
    result = CliRunner().invoke(app, ["push", str(run), *args])
    assert TOKEN not in result.stdout + result.stderr
    return result


def test_push_uploads_the_promoted_adapter_with_its_card(hub: FakeHub, run: Path) -> None:
    done = _push(hub, run, "--repo", "alice/tiny-moe", "--base-model", "Qwen/Qwen3-30B-A3B",
                 "--license", "apache-2.0", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    repo = hub.repos["alice/tiny-moe"]
    assert repo["visibility"] == "private" and doc["private"] is True and doc["vouched"] is True
    assert all(r["authorised"] for r in hub.requests)
    ops = [r["path"].split("/")[5] if r["path"].startswith("/api/models") else r["path"]
           for r in hub.requests]  # fmt: skip
    assert ops == ["/api/repos/create", "/api/validate-yaml", "preupload", "commit"]  # one commit
    adapter = run / "adapter"
    expected = {p.name for p in adapter.iterdir()} - {"PROMOTED", "README.md"} | {"README.md"}
    assert set(repo["files"]) == expected == set(doc["files"])
    for name in expected - {"README.md"}:
        assert repo["files"][name] == (adapter / name).read_bytes(), name
    card_text = repo["files"]["README.md"].decode()
    assert TOKEN not in card_text
    card = ModelCard(card_text)  # huggingface_hub's own parser of the Hub's metadata
    assert card.data.base_model == "Qwen/Qwen3-30B-A3B" and card.data.library_name == "peft"
    assert card.data.license == "apache-2.0" and {"moetune", "lora", "sft"} <= set(card.data.tags)
    coverage = json.loads((run / "coverage.json").read_text())
    body = card.text
    assert f"{coverage['adapted']}/{coverage['expected']} targets (100%)" in body
    assert "frozen (no LoRA on it); unchanged by training" in body
    assert "- `reverse.jsonl`: 16 rows × weight 1.0" in body and str(run.parent) not in body
    assert "Gate verdict: **GO**" in body and "promoted (verdict" in body
    for name, role, delta in RUNGS:
        assert f"| {name} | {role} | pass | {delta:+.4g} |" in body
    assert 'PeftModel.from_pretrained(base, "alice/tiny-moe")' in body
    rows = _ledger(run)
    assert rows[-1]["status"] == "ok" and rows[-1]["metrics"]["repo"] == "alice/tiny-moe"
    assert rows[-1]["metrics"]["commit"] == doc["commit"]


def test_an_unpromoted_or_no_go_adapter_is_refused(
    hub: FakeHub, run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "run-nogo"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    (copy / "eval" / "verdict.json").write_text(json.dumps(_verdict(copy / "adapter", "NO-GO")))
    done = _push_here(hub, copy, monkeypatch, "--repo", "alice/nogo")  # promoted, then re-gated
    assert done.exit_code == 2 and "a later gate said NO-GO" in done.stderr
    (copy / "adapter" / "PROMOTED").unlink()
    done = _push_here(hub, copy, monkeypatch, "--repo", "alice/nogo")
    assert done.exit_code == 2 and hub.requests == []
    assert "not promoted (the gate said NO-GO)" in done.stderr and "--unpromoted" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    refused = _ledger(run)[-1]  # the copy keeps the run's ledger (config.yaml)
    assert refused["status"] == "failed" and "not promoted" in refused["reason"]
    done = _push_here(hub, copy, monkeypatch, "--repo", "alice/nogo", "--unpromoted", "--public")
    assert done.exit_code == 0, done.stderr
    assert hub.repos["alice/nogo"]["visibility"] == "public"
    card = ModelCard(hub.repos["alice/nogo"]["files"]["README.md"].decode())
    assert "Promotion: not promoted." in card.text and "Gate verdict: **NO-GO**" in card.text
    assert "base_model" not in card.data.to_dict()  # a local base: no Hub id to claim


def test_a_push_the_hub_refuses_is_one_line_and_a_failed_ledger_row(
    hub: FakeHub, run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = _push_here(hub, run, monkeypatch, "--repo", "alice/no-token", token="wrong-token-5d1e0b")
    assert done.exit_code == 2 and "Traceback" not in done.stderr
    assert "the Hub refused the push to alice/no-token" in done.stderr
    assert "wrong-token-5d1e0b" not in done.stderr
    assert _ledger(run)[-1]["status"] == "failed"


def test_an_export_goes_up_only_once_checked(
    hub: FakeHub, run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "run-export"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "config.json").write_text("{}")
    (merged / "model.safetensors").write_bytes(b"\0" * 64)
    check = {"passed": True, "consumer": "transformers", "items": 4, "logits_rel": 1e-7,
             "expert_effect": 0.3, "greedy_match": 1.0}  # fmt: skip
    (copy / "exports.json").write_text(json.dumps({"merged": {"out": str(merged), "check": check}}))
    (merged / "UNCHECKED").write_text("unchecked")
    done = _push_here(hub, copy, monkeypatch, "--repo", "alice/merged", "--export", "merged")
    assert done.exit_code == 2 and "did not pass served == trained" in done.stderr
    (merged / "UNCHECKED").unlink()
    done = _push_here(
        hub, copy, monkeypatch, "--repo", "alice/merged", "--export", "merged", "--json"
    )
    assert done.exit_code == 0, done.stderr
    files = hub.repos["alice/merged"]["files"]
    assert set(files) == {"config.json", "model.safetensors", "README.md"}
    card = ModelCard(files["README.md"].decode())
    assert card.data.library_name == "transformers"
    assert "| merged | transformers | served == trained |" in card.text
    done = _push_here(hub, copy, monkeypatch, "--repo", "alice/merged", "--export", "gguf")
    assert done.exit_code == 2 and "has no gguf export on disk (exports: merged)" in done.stderr


def test_a_record_of_an_unexpected_shape_leaves_its_section_out(run: Path, tmp_path) -> None:
    """A card is still written (and still parses) when one record is damaged."""
    copy = tmp_path / "run-odd"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    coverage = json.loads((copy / "coverage.json").read_text())
    (copy / "coverage.json").write_text(json.dumps({**coverage, "by_kind": {"experts": 3}}))
    text = model_card(load_inputs(copy, None), "alice/odd", "adapter", None, None)
    card = ModelCard(text)
    assert card.data.library_name == "peft"
    assert "a section is not available" in card.text and "## Data" in card.text
    assert "Gate verdict: **GO**" in card.text


@pytest.mark.slow
def test_a_real_merged_export_goes_up_with_its_check(
    hub: FakeHub, run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`moetune export --format merged` (its served == trained check included), then push."""
    copy = tmp_path / "run-merged"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    items = write_jsonl(tmp_path / "items.jsonl", reverse_rows(4))
    out = tmp_path / "merged"
    exported = CliRunner().invoke(
        app, ["export", str(copy), "--format", "merged", "--out", str(out), "--items", str(items)]
    )
    assert exported.exit_code == 0, exported.stderr
    done = _push_here(hub, copy, monkeypatch, "--repo", "alice/merged-real", "--export", "merged")
    assert done.exit_code == 0, done.stderr
    files = hub.repos["alice/merged-real"]["files"]
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert set(files) == on_disk - {"README.md"} | {"README.md"}
    weights = [f for f in files if f.endswith(".safetensors")]
    assert weights and all(files[f] == (out / f).read_bytes() for f in weights)
    card = ModelCard(files["README.md"].decode())
    assert card.data.library_name == "transformers" and "served == trained" in card.text
