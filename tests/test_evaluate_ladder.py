"""`moetune eval` / `moetune gate`: the ladder on the shipped demo base with real adapters –
one that changes nothing (LoRA B = 0) and one that breaks the model – scored per item,
gated, promoted only on GO, and every attempt in the ledger."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from moetune.cli import app
from moetune.demo.base import SHIPPED_DIR, load_base
from moetune.demo.skills import make_items, write_jsonl
from moetune.ledger import Ledger

SKILLS = ("copy", "rev", "first")


def save_adapter(path: Path, scale: float) -> Path:
    """A LoRA adapter on attention; scale 0 leaves B = 0 (the base exactly), > 0 breaks it."""
    from peft import LoraConfig, get_peft_model

    model, _ = load_base()
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * scale)
    peft_model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "identity": save_adapter(root / "identity", 0.0),
        "broken": save_adapter(root / "broken", 3.0),
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    files = {}
    for skill in SKILLS:
        items = make_items([skill], 60, 0, "eval")
        rows = [{"prompt": it.prompt, "answer": it.answer} for it in items]
        files[skill] = write_jsonl(root / f"{skill}.jsonl", rows)
    items = make_items(["copy"], 40, 1, "eval")
    files["loss"] = write_jsonl(
        root / "loss.jsonl", [{"prompt": it.prompt, "completion": it.answer} for it in items]
    )
    return files


def write_config(
    tmp: Path, data: dict[str, Path], rungs: list[dict[str, Any]] | None = None
) -> Path:
    rungs = rungs or [
        {"name": s, "kind": "exact_match", "role": "protected", "data": str(data[s])}
        for s in SKILLS
    ]
    cfg = {
        "model": {"id": str(SHIPPED_DIR), "dtype": "float32"},
        "output": {"dir": str(tmp / "run"), "ledger": str(tmp / "ledger.jsonl")},
        "train": {"device": "cpu"},
        "eval": {"rungs": rungs, "batch_size": 64},
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, [*args])


def ledger_kinds(tmp: Path) -> list[tuple[str, str]]:
    return [(r.kind, r.status) for r in Ledger(tmp / "ledger.jsonl").read().rows]


def test_unchanged_adapter_is_go_and_promotes(
    tmp_path: Path, adapters: dict[str, Path], data: dict[str, Path]
) -> None:
    config = write_config(tmp_path, data)
    out = invoke("eval", str(config), "--adapter", str(adapters["identity"]), "--json")
    assert out.exit_code == 0, out.output
    verdict = json.loads(out.stdout)
    assert verdict["verdict"] == "GO"
    results = tmp_path / "run" / "eval"
    for rung in verdict["rungs"]:
        assert rung["n"] == 60 and rung["delta"] == 0.0  # the same model: no item differs
        assert rung["base_score"] == 1.0  # the shipped base knows copy / rev / first
        rung_json = json.loads((results / "rungs" / f"{rung['name']}.json").read_text())
        assert rung_json["n"] == 60 and rung_json["base"]["stderr"] == 0.0
        rows = (results / "rungs" / f"{rung['name']}.items.jsonl").read_text().splitlines()
        assert len(rows) == 60
        assert all(json.loads(r)["base_output"] == json.loads(r)["candidate_output"] for r in rows)
    assert json.loads((results / "verdict.json").read_text())["hash"] == verdict["hash"]

    gated = invoke("gate", str(results), "--promote", "--json")
    assert gated.exit_code == 0, gated.output
    marker = adapters["identity"] / "PROMOTED"
    assert json.loads(marker.read_text())["verdict_hash"] == verdict["hash"]
    assert ledger_kinds(tmp_path) == [
        ("eval", "ok"),
        ("gate", "ok"),
        ("gate", "ok"),
        ("promote", "ok"),
    ]
    marker.unlink()  # the fixture adapter is shared


def test_broken_adapter_is_no_go_and_never_promoted(
    tmp_path: Path, adapters: dict[str, Path], data: dict[str, Path]
) -> None:
    config = write_config(tmp_path, data)
    out = invoke("eval", str(config), "--adapter", str(adapters["broken"]))
    assert out.exit_code == 1, out.output  # as `gate`: `eval && export` stops at a NO-GO
    assert "NO-GO" in out.stdout and "failing rungs, worst items" in out.stdout
    assert out.stderr.strip().splitlines()[-1].startswith("fix: do not promote")  # after warnings
    gated = invoke("gate", str(tmp_path / "run" / "eval"), "--promote", "--json")
    assert gated.exit_code == 1
    doc = json.loads(gated.stdout)
    assert doc["verdict"] == "NO-GO" and doc["promoted"] is None
    assert any(r["status"] == "fail" and r["role"] == "protected" for r in doc["rungs"])
    assert not (adapters["broken"] / "PROMOTED").exists()
    assert ("promote", "ok") not in ledger_kinds(tmp_path)
    # the ledger says what the gate decided: a NO-GO gate row is never `ok`
    assert ledger_kinds(tmp_path) == [("eval", "ok"), ("gate", "no-go"), ("gate", "no-go")]
    # per failing rung, its worst items as the user's file gave them and as each model answered
    for rung in (r for r in doc["rungs"] if r["status"] == "fail"):
        shown = rung["examples"]
        assert len(shown) == 3 and all(ex["candidate_output"] != ex["expected"] for ex in shown)
        first = json.loads(data[rung["name"]].read_text().splitlines()[shown[0]["i"]])
        assert (shown[0]["prompt"], shown[0]["expected"]) == (first["prompt"], first["answer"])
        assert shown[0]["base_output"] == first["answer"]  # the base knows the skill


def test_limit_gives_inconclusive_never_go(
    tmp_path: Path, adapters: dict[str, Path], data: dict[str, Path]
) -> None:
    config = write_config(tmp_path, data)
    out = invoke(
        "eval", str(config), "--adapter", str(adapters["identity"]), "--limit", "4", "--json"
    )
    doc = json.loads(out.stdout)
    assert doc["verdict"] == "INCONCLUSIVE" and out.exit_code == 1  # never GO: exit 1
    assert all(r["n"] == 4 and r["n_needed"] > 4 for r in doc["rungs"])
    # what to do next, in the --json object (stderr stays empty) and after the table
    first = doc["rungs"][0]
    assert f"{first['name']} about {first['n_needed']} (has 4)" in doc["fix"] and not out.stderr
    gated = invoke("gate", str(tmp_path / "run" / "eval"))
    assert gated.exit_code == 1 and gated.stderr.strip().startswith("fix: score more items")
    # a caller that gates the results itself (the lane, on a pod) asks for exit 0
    again = ("eval", str(config), "--adapter", str(adapters["identity"]), "--limit", "4")
    assert invoke(*again, "--overwrite", "--no-gate-exit").exit_code == 0
    from moetune.evaluate import GateError, promote

    with pytest.raises(GateError, match="INCONCLUSIVE"):
        promote(tmp_path / "run" / "eval")


def test_results_are_never_silently_replaced(
    tmp_path: Path, adapters: dict[str, Path], data: dict[str, Path]
) -> None:
    config = write_config(tmp_path, data)
    args = ("eval", str(config), "--adapter", str(adapters["identity"]), "--limit", "2")
    assert invoke(*args).exit_code == 1  # 2 items: INCONCLUSIVE, results written
    again = invoke(*args)
    assert again.exit_code == 2 and "--overwrite" in again.output
    assert invoke(*args, "--overwrite").exit_code == 1
    assert ledger_kinds(tmp_path).count(("eval", "failed")) == 1  # the refused attempt


def test_promote_refuses_edited_verdict_and_changed_adapter(
    tmp_path: Path, data: dict[str, Path]
) -> None:
    from moetune.evaluate import GateError, promote

    adapter = save_adapter(tmp_path / "adapter", 0.0)
    config = write_config(tmp_path, data)
    assert invoke("eval", str(config), "--adapter", str(adapter)).exit_code == 0
    results = tmp_path / "run" / "eval"
    verdict_file = results / "verdict.json"
    original = verdict_file.read_text()
    edited = json.loads(original) | {"reason": "trust me"}
    verdict_file.write_text(json.dumps(edited))
    with pytest.raises(GateError, match="edited"):
        promote(results)
    verdict_file.write_text(original)
    (adapter / "adapter_model.safetensors").write_bytes(b"retrained since")
    with pytest.raises(GateError, match="changed since it was evaluated"):
        promote(results)
    assert not (adapter / "PROMOTED").exists()


def test_loss_rung_is_minus_mean_nll_and_paired(
    tmp_path: Path, adapters: dict[str, Path], data: dict[str, Path]
) -> None:
    rung = {"name": "loss", "kind": "loss", "role": "protected", "margin": 0.05,
            "data": str(data["loss"])}  # fmt: skip
    config = write_config(tmp_path, data, [rung])
    out = invoke("eval", str(config), "--adapter", str(adapters["broken"]), "--json")
    doc = json.loads(out.stdout)
    assert doc["verdict"] == "NO-GO"  # the broken adapter's loss is far worse
    ladder = json.loads((tmp_path / "run" / "eval" / "ladder.json").read_text())
    summary = ladder["rungs"][0]
    assert summary["unit"] == "neg_nll"
    assert summary["extra"]["base_perplexity"] == pytest.approx(math.exp(-summary["base"]["score"]))
    # the first item by hand: mean NLL of the completion tokens under the base
    model, tok = load_base()
    first = json.loads(data["loss"].read_text().splitlines()[0])
    ctx = tok(first["prompt"])["input_ids"]
    cont = tok(first["completion"], add_special_tokens=False)["input_ids"]
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], dim=-1)
    nll = -sum(float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont)) / len(cont)
    row = json.loads((tmp_path / "run/eval/rungs/loss.items.jsonl").read_text().splitlines()[0])
    assert row["base"] == pytest.approx(-nll, rel=1e-5)
    assert row["candidate"] < row["base"]


def test_eval_errors_are_one_line_and_ledgered(tmp_path: Path, data: dict[str, Path]) -> None:
    config = write_config(tmp_path, data)
    out = invoke("eval", str(config))  # no adapter trained at <output.dir>/adapter
    assert out.exit_code == 2 and "no peft adapter" in out.output and "fix:" in out.output
    empty = write_config(tmp_path, data, [])
    out = invoke("eval", str(empty), "--set", "eval.rungs=[]")
    assert out.exit_code == 2 and "eval.rungs" in out.output
    assert ledger_kinds(tmp_path) == [("eval", "failed"), ("eval", "failed")]
    out = invoke("gate", str(tmp_path / "nowhere"))
    assert out.exit_code == 2 and "ladder.json" in out.output


def test_an_adapter_swapped_after_promotion_is_refused_by_eval_export_and_launch(
    tmp_path: Path, adapters: dict[str, Path], data: dict[str, Path]
) -> None:
    import shutil

    adapter = tmp_path / "run" / "adapter"
    shutil.copytree(adapters["identity"], adapter)
    config = write_config(tmp_path, data)
    out = invoke("eval", str(config), "--adapter", str(adapter), "--limit", "30", "--json")
    assert out.exit_code == 0 and json.loads(out.stdout)["verdict"] == "GO", out.output
    assert invoke("gate", str(tmp_path / "run" / "eval"), "--promote").exit_code == 0
    recorded = json.loads((adapter / "PROMOTED").read_text())["adapter_sha256"]
    assert (
        recorded == json.loads((tmp_path / "run/eval/verdict.json").read_text())["adapter_sha256"]
    )
    shutil.copy(adapters["broken"] / "adapter_model.safetensors", adapter)  # swapped afterwards
    refused = [
        invoke("eval", str(config), "--adapter", str(adapter), "--overwrite"),
        invoke("export", str(adapter), "--format", "vllm", "--out", str(tmp_path / "x"),
               "--base", str(SHIPPED_DIR)),
        invoke("launch", str(config), "--resume", "any-run"),
    ]  # fmt: skip
    for out in refused:
        assert out.exit_code == 2 and "Traceback" not in out.output, out.output
        assert "changed after it was promoted" in out.output, out.output
        assert "gate --promote" in out.output  # the way back
    assert not (tmp_path / "x").exists()
    assert (tmp_path / "run/eval/ladder.json").is_file()  # the old results stay


def test_eval_results_on_a_full_disk_are_one_line_and_leave_nothing(
    tmp_path: Path, adapters: dict[str, Path], data: dict[str, Path], monkeypatch
) -> None:
    """Issue 36 item 8: ENOSPC while the results are written was exit 3 (OSError); now one
    line, the attempt ledgered as failed, no results dir and no temp dir left behind."""
    import errno
    import os

    import moetune.evaluate.ladder as ladder_mod

    def full(path: Path, *args: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ladder_mod, "atomic_write_text", full)
    config = write_config(tmp_path, data)
    args = ("eval", str(config), "--adapter", str(adapters["identity"]), "--limit", "2")
    out = invoke(*args)
    assert out.exit_code == 2 and "Traceback" not in out.output
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "free space" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ledger.jsonl",
        "ledger.jsonl.lock",
        "run.yaml",
    ]
    assert ledger_kinds(tmp_path) == [("eval", "failed")]


def test_an_unwritable_results_dir_is_refused_before_any_model(
    tmp_path: Path, adapters: dict[str, Path], data: dict[str, Path], monkeypatch
) -> None:
    import moetune.evaluate.ladder as ladder_mod

    monkeypatch.setattr(ladder_mod, "load_model", lambda cfg: pytest.fail("a model was loaded"))
    (tmp_path / "a-file").write_text("x")
    config = write_config(tmp_path, data)
    for results, why in ((tmp_path / "a-file" / "eval", "is not a directory"),
                         (tmp_path / "a-file", "is a file, not a folder")):  # fmt: skip
        out = invoke("eval", str(config), "--adapter", str(adapters["identity"]),
                     "--set", f"eval.results_dir={results}")  # fmt: skip
        assert out.exit_code == 2 and why in out.stderr and "fix:" in out.stderr
