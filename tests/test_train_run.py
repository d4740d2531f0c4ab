"""End to end: `train()` on a tiny Qwen3-MoE (CPU, fp32) – outputs, coverage, router,
aux loss, preflight gate, refusals, and an adapter that plain peft loads."""

from __future__ import annotations

import dataclasses
import json
import math
import types
from pathlib import Path

import pytest
import torch

from moetune.config import dump_config
from moetune.plan.overhead import CPU_PROCESS_BASELINE
from moetune.train import TrainError, TrainResult, train
from moetune.train import trainer as trainer_mod
from moetune.train.errors import DataError
from moetune.train.rundir.checkpoint import inspect_run
from test_train_helpers import (
    GEN_TEMPLATE,
    one_thread,
    reverse_rows,
    run_config,
    save_tiny_model,
    write_jsonl,
)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    model = save_tiny_model(root / "model")
    data = write_jsonl(root / "train.jsonl", reverse_rows(24))
    held_out = write_jsonl(root / "eval.jsonl", reverse_rows(4))
    return types.SimpleNamespace(root=root, model=model, data=data, held_out=held_out)


@pytest.fixture(scope="module")
def done(files):
    """One finished run, with the in-memory trained model's logits captured at save time."""
    cfg = run_config(
        files.model, files.data, files.root / "run", data__eval_file=str(files.held_out)
    )
    probe = torch.tensor([[10, 11, 12, 4, 30, 31]])
    captured = {}
    real_save = trainer_mod.save_adapter

    def spy(trainer, run):
        trainer.model.eval()
        with torch.no_grad():
            captured["logits"] = trainer.model(input_ids=probe).logits.clone()
        return real_save(trainer, run)

    with pytest.MonkeyPatch.context() as mp, one_thread():
        mp.setattr(trainer_mod, "save_adapter", spy)
        result = train(cfg, progress=False)
    run = Path(result.run_dir)
    return types.SimpleNamespace(cfg=cfg, result=result, run=run, probe=probe, **captured)


def _json(path: Path):
    return json.loads(path.read_text())


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_writes_every_output_and_nothing_half_written(done):
    names = {p.name for p in done.run.iterdir()}
    assert names == {
        "config.yaml",
        "versions.json",
        "preflight.json",
        "data.json",
        "coverage.json",
        "metrics.jsonl",
        "routing.jsonl",
        "checkpoints",
        "adapter",
        "summary.json",
    }  # fmt: skip  (no temp files, no staging dir left)
    assert (done.run / "config.yaml").read_text() == dump_config(done.cfg)
    versions = _json(done.run / "versions.json")
    assert {"torch", "transformers", "peft", "trl", "git_sha"} <= set(versions)
    assert versions["device"] == "cpu" and versions["precision"] == "fp32"
    adapter = {p.name for p in (done.run / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= adapter
    assert "training_args.bin" not in adapter
    assert sorted(p.name for p in (done.run / "checkpoints").iterdir()) == ["step-3", "step-6"]
    data = _json(done.run / "data.json")
    assert data["format"] == "prompt/completion" and data["loss_on"] == "completion tokens"


def test_result_fields(done):
    r = done.result
    assert (r.steps, r.coverage, r.router_changed, r.aux_loss) == (6, 1.0, False, False)
    assert math.isfinite(r.final_loss) and r.seconds > 0
    assert r.adapter_dir == str(done.run / "adapter")
    assert TrainResult.from_json(r.to_json()) == r


def test_coverage_audit_every_expert_stack_adapted(done):
    report = _json(done.run / "coverage.json")
    assert report["coverage"] == 1.0 and not report["missed"]
    assert report["by_kind"]["experts"] == {"adapted": 4, "expected": 4}  # 2 layers x 2 stacks
    assert report["router"] == {"0": "frozen", "1": "frozen"}


def test_frozen_router_unchanged_and_aux_loss_off(done):
    summary = _json(done.run / "summary.json")
    router = summary["router"]
    assert router["changed"] is False and router["trainable"] is False
    assert router["sha256_before"] == router["sha256_after"]
    assert summary["aux_loss"] == {"enabled": False, "coef": 0.0, "reason": "router frozen"}
    assert summary["engine"] == "moetune"  # lora.engine auto on qwen3_moe: split LoRA
    assert _json(done.run / "preflight.json")["aux_loss"]["enabled"] is False
    assert all("aux_loss" not in row for row in _jsonl(done.run / "metrics.jsonl"))


def test_metrics_rows(done):
    rows = _jsonl(done.run / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    for row in train_rows:
        assert math.isfinite(row["loss"]) and row["lr"] >= 0
        assert row["tokens_per_s"] > 0 and row["memory_bytes"] > 0
    assert train_rows[0]["lr"] > train_rows[-1]["lr"]  # cosine decay
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6]


def test_routing_records(done):
    rows = _jsonl(done.run / "routing.jsonl")
    assert [r["step"] for r in rows] == [2, 4, 6]
    for row in rows:
        assert [x["layer"] for x in row["layers"]] == [0, 1]
        for layer in row["layers"]:
            assert sum(layer["tokens_per_expert"]) == 2 * layer["tokens"] > 0  # top-2
            assert 0.0 <= layer["entropy"] <= 1.0
            assert layer["min_fraction"] <= 0.25 <= layer["max_fraction"]
    summary = _json(done.run / "summary.json")["routing"]
    assert summary["records"] == 3 and set(summary["layers"]) == {"0", "1"}


def test_measured_memory_next_to_the_plan(done):
    summary = _json(done.run / "summary.json")
    memory = summary["memory"]
    plan = _json(done.run / "preflight.json")["plan"]
    assert memory["measured_peak_bytes"] == done.result.peak_memory_bytes > 0
    assert memory["measured"] == "process_peak_rss"
    # On CPU the peak RSS holds the whole process: the figure it meets is the plan's tensors
    # plus the measured process baseline (it read "measured 5x planned" against tensors alone)
    process = plan["peak_bytes"] + CPU_PROCESS_BASELINE
    assert memory["planned_peak_bytes"] == process == done.result.planned_peak_bytes
    run_plan = _json(done.run / "preflight.json")["run_plan"]  # no offload, one process
    assert (memory["planned_by"], run_plan["peak_bytes"]) == ("memory", process)
    assert run_plan["components"]["process_baseline"] == CPU_PROCESS_BASELINE
    assert done.result.planned_by == "one device" and "peak RSS" in memory["compared"]
    # the ratio itself: the RSS of this test session's process (everything earlier tests
    # left resident) says nothing of the run – measured alone, the demo reads 0.88x
    ratio = round(memory["measured_peak_bytes"] / process, 4)
    assert memory["measured_over_planned"] == ratio, memory


def test_adapter_loads_with_plain_peft_and_gives_the_same_logits(done, files):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(files.model, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(input_ids=done.probe).logits.clone()
        tuned = PeftModel.from_pretrained(base, done.result.adapter_dir).eval()
        logits = tuned(input_ids=done.probe).logits
    torch.testing.assert_close(logits, done.logits, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(logits, base_logits, atol=1e-4)  # the adapter does something


def test_finished_run_is_never_overwritten(done):
    before = {p: p.stat().st_mtime_ns for p in done.run.rglob("*")}
    with pytest.raises(TrainError, match="finished run") as info:
        train(done.cfg, progress=False)
    assert "output.dir" in info.value.fix
    assert {p: p.stat().st_mtime_ns for p in done.run.rglob("*")} == before


def test_resuming_a_finished_run_says_so_and_adds_no_ledger_row(done):
    """`train --resume` on a complete run: its recorded result, exit 0, "already complete",
    and the ledger keeps one row for the one run (a second row counted it twice)."""
    from typer.testing import CliRunner

    from moetune.cli import app
    from moetune.ledger import Ledger

    rows = len(Ledger(done.cfg.output.ledger).read().rows)
    again = train(done.cfg, resume=True, progress=False)  # nothing left to do
    assert again == dataclasses.replace(done.result, already_complete=True)
    saved = str(done.run / "config.yaml")
    cli = CliRunner().invoke(app, ["train", saved, "--resume"])
    assert cli.exit_code == 0, cli.output
    assert f"already complete: {done.run} finished at step {done.result.steps}" in cli.output
    assert len(Ledger(done.cfg.output.ledger).read().rows) == rows


def test_ledger_row_carries_the_measured_rate_and_its_step(files, tmp_path, monkeypatch):
    """One full epoch of rows of different lengths: the row's tokens are exactly the
    non-padding tokens of every row the trainer tokenised (padding excluded)."""
    from moetune.ledger import Ledger

    seen = {}
    real_fit = trainer_mod.fit

    def spy(trainer, setup, console):
        real_fit(trainer, setup, console)
        seen["lengths"] = [len(r["input_ids"]) for r in trainer.train_dataset]

    monkeypatch.setattr(trainer_mod, "fit", spy)
    data = write_jsonl(tmp_path / "six.jsonl", reverse_rows(6))
    cfg = run_config(files.model, data, tmp_path / "t", max_steps=None, epochs=1, save_steps=50,
                     routing_every=0)  # fmt: skip
    with one_thread():
        result = train(cfg, progress=False)
    lengths = seen["lengths"]
    assert len(lengths) == 6 and max(lengths) <= 32
    # a length seen an odd number of times: whatever the order, some batch of 2 is padded
    assert any(lengths.count(n) % 2 for n in lengths)
    (row,) = Ledger(cfg.output.ledger).read().rows
    m = row.metrics
    assert m["steps"] == 3 and m["tokens"] == sum(lengths) == result.tokens
    assert m["tokens_per_s"] > 0 and 0 < m["loop_seconds"] < result.seconds  # the loop only
    assert m["tokens_per_s"] == pytest.approx(m["tokens"] / m["loop_seconds"], rel=1e-2)
    assert (m["device"], m["card"]) == ("cpu", None)
    assert m["signature"] == {
        "model": str(files.model), "engine": "moetune", "experts_dtype": "bf16",
        "precision": "auto", "seq_len": 32, "batch_size": 2, "gradient_checkpointing": True,
        "lora_rank": 4, "lora_expert_rank": 4, "devices": 1,
        "lora_targets": ["attention", "dense", "experts", "shared"],
    }  # fmt: skip


def test_done_run_tokens_match_the_metrics_log(done):
    last = [r for r in _jsonl(done.run / "metrics.jsonl") if "tokens" in r][-1]
    assert done.result.tokens == last["tokens"] > 0  # one counter: TRL's non-padding count


# ---------------------------------------------------------------- router and aux loss


def test_train_router_turns_on_the_aux_loss_and_changes_the_router(files, tmp_path):
    cfg = run_config(
        files.model, files.data, tmp_path / "r", max_steps=3, save_steps=50,
        routing_every=0, lora__train_router=True,
    )  # fmt: skip
    with one_thread():
        result = train(cfg, progress=False)
    assert result.router_changed is True and result.aux_loss is True
    summary = _json(tmp_path / "r" / "summary.json")
    assert summary["aux_loss"] == {"enabled": True, "coef": 0.001, "reason": "lora.train_router"}
    assert summary["router"]["trainable"] and summary["router"]["max_abs_change"] > 0
    assert _json(tmp_path / "r" / "coverage.json")["router"] == {"0": "lora", "1": "lora"}
    rows = _jsonl(tmp_path / "r" / "metrics.jsonl")
    assert all(row["aux_loss"] > 0 for row in rows)


def test_explicit_aux_loss_keeps_a_frozen_router_unchanged(files, tmp_path):
    cfg = run_config(
        files.model, files.data, tmp_path / "a", max_steps=2, save_steps=50,
        routing_every=0, aux_loss=True,
    )  # fmt: skip
    with one_thread():
        result = train(cfg, progress=False)
    assert result.aux_loss is True and result.router_changed is False
    assert _json(tmp_path / "a" / "summary.json")["aux_loss"]["reason"] == "train.aux_loss"


# ---------------------------------------------------------------- preflight and refusals


# engine peft refuses dropout on fused experts: a preflight error (engine auto would apply it)
PEFT_DROPOUT = {"lora__dropout": 0.1, "lora__engine": "peft"}


def test_every_attempt_leaves_a_ledger_row(done, files, tmp_path):
    from moetune.ledger import Ledger

    ok = [r for r in Ledger(done.cfg.output.ledger).read().rows if r.status == "ok"]
    assert ok and ok[0].kind == "train" and ok[0].metrics["steps"] == done.result.steps
    bad = run_config(files.model, files.data, tmp_path / "bad", **PEFT_DROPOUT)
    with pytest.raises(TrainError):
        train(bad, progress=False)
    (row,) = Ledger(bad.output.ledger).read().rows
    assert row.status == "failed" and "MOE-LORA-DROPOUT" in row.reason


def test_preflight_error_stops_the_run_before_writing(files, tmp_path):
    cfg = run_config(files.model, files.data, tmp_path / "x", **PEFT_DROPOUT)
    with pytest.raises(TrainError, match="MOE-LORA-DROPOUT") as info:
        train(cfg, progress=False)
    assert "--allow-errors" in info.value.fix
    assert not (tmp_path / "x").exists()


def test_allow_errors_trains_and_records_the_override(files, tmp_path, monkeypatch):
    import moetune.lint.preflight
    import moetune.train.setup
    from moetune.lint.registry import Finding

    real = moetune.lint.preflight.lint_run

    def with_error(cfg, estimator="analytic", spec=None):
        findings, plan = real(cfg, estimator, spec=spec)
        return [Finding("TEST-ERR", "error", "a test error", "ignore it"), *findings], plan

    monkeypatch.setattr(moetune.train.setup, "lint_run", with_error)  # where train calls it
    cfg = run_config(files.model, files.data, tmp_path / "o", max_steps=1, routing_every=0)
    with pytest.raises(TrainError, match=r"\[TEST-ERR\] a test error"):
        train(cfg, progress=False)
    with one_thread():
        result = train(cfg, allow_errors=True, progress=False)
    assert result.errors_overridden == ["TEST-ERR"] and result.steps == 1
    assert _json(tmp_path / "o" / "preflight.json")["errors_overridden"] == ["TEST-ERR"]


def test_bad_data_writes_nothing(files, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 2"):
        train(run_config(files.model, bad, tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_incomplete_coverage_refuses_to_train(files, tmp_path, monkeypatch):
    import moetune.recipe.targets as targets
    import moetune.train.model

    real = targets.build_peft_config

    def attention_only(spec, lora, model=None):
        config = real(spec, lora, model)
        config.target_parameters = None  # the fused expert stacks silently get no LoRA
        return config

    monkeypatch.setattr(moetune.train.model, "build_peft_config", attention_only)  # as bound
    cfg = run_config(files.model, files.data, tmp_path / "c")
    with pytest.raises(TrainError, match=r"only 8/12 requested LoRA targets") as info:
        train(cfg, progress=False)
    assert "experts mlp.experts.gate_up_proj" in info.value.cause
    report = _json(tmp_path / "c" / "coverage.json")
    assert report["coverage"] == pytest.approx(8 / 12)
    assert not (tmp_path / "c" / "checkpoints").exists()
    inspect_run(cfg, resume=False)  # nothing trained: the dir may be reused as it is


def test_output_dir_not_writable(files, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a directory")
    cfg = run_config(files.model, files.data, blocker / "run", max_steps=1)
    cfg.output.ledger = str(tmp_path / "ledger.jsonl")  # the ledger is fine: the dir is not
    with pytest.raises(TrainError, match="not writable"):
        train(cfg, progress=False)


def test_foreign_directory_is_refused(files, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    cfg = run_config(files.model, files.data, tmp_path / "mine")
    for resume, overwrite in ((False, False), (True, False), (False, True)):
        with pytest.raises(TrainError, match="holds no moetune run"):
            train(cfg, resume=resume, overwrite=overwrite, progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# ---------------------------------------------------------------- other formats


def test_messages_rows_train_on_assistant_turns(tmp_path):
    model = save_tiny_model(tmp_path / "chat-model", chat_template=GEN_TEMPLATE)

    def chat(w: str) -> dict:
        return {"messages": [{"role": "user", "content": f"rev:{w}"},
                             {"role": "assistant", "content": w[::-1]}]}  # fmt: skip

    turns = [chat(w) for w in ("abc", "moe", "lora", "gate") * 3]
    data = write_jsonl(tmp_path / "chat.jsonl", turns)
    cfg = run_config(model, data, tmp_path / "m", max_steps=2, save_steps=50, routing_every=1)
    with one_thread():
        result = train(cfg, progress=True)
    assert result.steps == 2 and math.isfinite(result.final_loss)
    assert _json(tmp_path / "m" / "data.json")["loss_on"] == "assistant turns"


def test_packed_text_rows(files, tmp_path):
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": f"copy:{w}>{w}"} for w in ("ab", "cde") * 8])
    cfg = run_config(
        files.model, data, tmp_path / "p", max_steps=2, save_steps=50, data__packing=True
    )
    with one_thread():
        result = train(cfg, progress=False)
    assert result.steps == 2 and math.isfinite(result.final_loss)
    rows = _jsonl(tmp_path / "p" / "routing.jsonl")
    assert rows and rows[0]["layers"][0]["tokens"] > 0


def test_overwrite_replaces_a_finished_run_only_when_asked(done, tmp_path):
    import shutil

    copy = tmp_path / "again"
    shutil.copytree(done.run, copy)
    (copy / "notes.txt").write_text("the user's own")
    (copy / "eval" / "rungs").mkdir(parents=True)
    (copy / "eval" / "ladder.json").write_text("{}")  # the earlier run's results: moetune's
    (copy / "eval" / "rungs" / "a.items.jsonl").write_text("")
    cfg = done.cfg.model_copy(deep=True)
    cfg.output.dir = str(copy)
    cfg.train.max_steps = 2
    with one_thread():
        result = train(cfg, overwrite=True, progress=False)
    assert result.steps == 2 and (copy / "notes.txt").read_text() == "the user's own"
    assert _json(copy / "summary.json")["result"]["steps"] == 2
    assert {r["step"] for r in _jsonl(copy / "metrics.jsonl")} == {1, 2}  # old rows gone
    assert not (copy / "eval").exists()  # its stale results too (the folder was left empty)
    assert not list(tmp_path.glob("again/.*.replaced-*"))  # the old run is gone, not half-kept


def test_overwrite_never_removes_a_promoted_adapter(done, tmp_path):
    import shutil

    copy = tmp_path / "promoted"
    shutil.copytree(done.run, copy)
    (copy / "adapter" / "PROMOTED").write_text('{"verdict_hash": "abc"}')
    weights = (copy / "adapter" / "adapter_model.safetensors").read_bytes()
    cfg = done.cfg.model_copy(deep=True)
    cfg.output.dir = str(copy)
    cfg.train.max_steps = 1
    with pytest.raises(TrainError, match=r"promoted adapter.*--overwrite-promoted"):
        train(cfg, overwrite=True, progress=False)
    assert (copy / "adapter" / "adapter_model.safetensors").read_bytes() == weights
    assert (copy / "adapter" / "PROMOTED").is_file()
    with one_thread():
        result = train(cfg, overwrite_promoted=True, progress=False)
    assert result.steps == 1 and not (copy / "adapter" / "PROMOTED").exists()
